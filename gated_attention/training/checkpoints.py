"""A run's resumable state: accelerate checkpoints, saved whole or not at all, checked before a resume; the
run's log, one record per step; Ctrl-C that names what a rerun continues from.

A run writes into OUTPUT:

- `checkpoints/step-NNNNNNN/`: `accelerator.save_state` (model, optimizer,
  the registered scheduler, RNG states), one `data_state_{rank}.json` per
  process for a stream's position, and `step.json`. It is written as
  `checkpoints/.step-NNNNNNN.incomplete-PID` and renamed into place when
  whole (`folders.publish`), so a folder named `step-*` is always a complete
  checkpoint, and a Ctrl-C, a crash or a full disk at any moment of a save
  leaves the earlier checkpoints as they were. Saving a step that exists
  already (a run resumed from an earlier step) replaces that checkpoint whole,
  never file by file.
- `log.jsonl`: one JSON record per finished step (`RunLog`).

A resume reads `latest_checkpoint` (the newest `step-*` folder) or a given
folder, after `check_checkpoint` has looked at every file it will read: a
damaged one (cut short by a disk that filled up, a copy that stopped) is one
line naming it, not a traceback from deep inside torch or safetensors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path

from torch import nn

from ..cli_common import first_line, sigterm_as_interrupt
from ..files.staging import staging_path
from .folders import full_disk_is_one_line, publish
from .loop import check_finite_weights

_STEP_FOLDER = re.compile(r"^step-(\d+)$")


def checkpoint_dir(output_dir, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step-{step:07d}"


def complete_checkpoints(output_dir) -> list[Path]:
    """The `step-*` folders under `output_dir/checkpoints` that have their `step.json`, oldest first.

    A staged save appears under that name only when whole, and `step.json` is written last: a folder that has
    it was written to the end.
    """
    folders = [p for p in (Path(output_dir) / "checkpoints").glob("step-*") if _STEP_FOLDER.match(p.name)]
    return sorted((p for p in folders if (p / "step.json").is_file()), key=lambda p: int(p.name[5:]))


def latest_checkpoint(output_dir) -> Path | None:
    """The newest complete checkpoint under `output_dir/checkpoints`, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message is one readable line."""


def _shared_tensor_note(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Removed shared tensor")


@contextlib.contextmanager
def _without_shared_tensor_note():
    """accelerate's `save_state` writes a model with tied weights (`lm_head.weight` is `embed_tokens.weight`)
    once and logs "Removed shared tensor {'lm_head.weight'} ... check ... while reloading" every time. A
    checkpoint is only ever loaded back into the live model (`load_checkpoint`), whose weights stay tied,
    so the note is noise there; this hides that one message while the checkpoint is written."""
    logger = logging.getLogger("accelerate.utils.other")
    logger.addFilter(_shared_tensor_note)
    try:
        yield
    finally:
        logger.removeFilter(_shared_tensor_note)


def save_checkpoint(accelerator, output_dir, step: int, data=None, *, model: nn.Module | None = None) -> Path:
    """Save the prepared objects as `checkpoint_dir(output_dir, step)`, staged and renamed into place.

    `accelerator.save_state` (model, optimizer, registered scheduler, RNG) and, for a stream (`data`, a
    `streaming.PackedStream`), its position, one `data_state_{rank}.json` per process (each reads its own
    part), as accelerate does for RNG states; `step.json` last. Every process writes into the same staging
    folder, named by the main process. With `model` (the prepared one), weights that are not finite are
    refused first (`check_finite_weights`). On any error or Ctrl-C the staging folder is removed.
    """
    folder = checkpoint_dir(output_dir, step)
    if model is not None:
        check_finite_weights(model, accelerator, step=step, saving=f"checkpoint {folder.name}")
    stage = staging_path(folder, "incomplete")
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        stage = Path(broadcast_object_list([str(stage)])[0])  # the main process's
    with full_disk_is_one_line(folder.parent, f"saving checkpoint {folder.name}"):
        _save_staged(accelerator, stage, folder, step, data)
    return folder


def _save_staged(accelerator, stage: Path, folder: Path, step: int, data) -> None:
    try:
        if accelerator.is_main_process:
            shutil.rmtree(stage, ignore_errors=True)  # an earlier process with this id was killed
            stage.mkdir(parents=True)
        accelerator.wait_for_everyone()
        with _without_shared_tensor_note():
            accelerator.save_state(str(stage))
        if data is not None and hasattr(data, "state_dict"):
            path = stage / f"data_state_{accelerator.process_index}.json"
            path.write_text(json.dumps(data.state_dict()), encoding="utf-8")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (stage / "step.json").write_text(json.dumps({"step": step}), encoding="utf-8")
            publish(stage, folder)
        accelerator.wait_for_everyone()
    except BaseException:
        if accelerator.is_main_process:
            shutil.rmtree(stage, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------
# Resuming


def _damage(path: Path) -> str | None:
    """What is wrong with one checkpoint file, read only as far as telling that takes; None if nothing.

    torch.save writes zip archives (`.bin`, `.pkl`, `.pt`), whose directory sits at the end: a file cut
    short has none. A safetensors header lists every tensor's bytes: `safe_open` checks the file covers them.
    """
    kinds = {".json": "JSON", ".safetensors": "safetensors file", ".bin": "torch.save archive",
             ".pkl": "torch.save archive", ".pt": "torch.save archive", ".pth": "torch.save archive"}
    if path.suffix not in kinds:
        return None  # not one we can tell (FSDP's sharded .distcp files): loading will say
    try:
        if path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        elif path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt"):
                pass
        else:
            size = path.stat().st_size
            with zipfile.ZipFile(path) as archive:
                for member in archive.infolist():
                    if member.header_offset + member.compress_size > size:
                        return f"cut short: {member.filename} runs past the end of the file"
    except Exception as e:  # noqa: BLE001 - BadZipFile, safetensors' SafetensorError, JSON, I/O: each one line
        return f"not a whole {kinds[path.suffix]}, cut short or overwritten? ({first_line(e)})"
    return None


def _earlier_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint of the same run older than `folder` (a `step-*` folder), if any."""
    named = _STEP_FOLDER.match(folder.name)
    if not named or folder.parent.name != "checkpoints":
        return None
    earlier = [p for p in complete_checkpoints(folder.parent.parent) if int(p.name[5:]) < int(named.group(1))]
    return earlier[-1] if earlier else None


def check_checkpoint(folder) -> int:
    """The step a `save_checkpoint` folder continues from, after a look at every file a resume reads;
    `CheckpointError` naming the first file that is missing or damaged, and an earlier checkpoint to use."""
    folder = Path(folder)
    step_file = folder / "step.json"
    if not step_file.is_file():
        raise CheckpointError(f"{folder} is not a complete checkpoint (no step.json); resume from a "
                              "checkpoints/step-* folder that has one, or 'latest'")

    def damaged(name: str, what: str) -> CheckpointError:
        earlier = _earlier_checkpoint(folder)
        instead = f"; resume from an earlier one: --resume {earlier}" if earlier else ""
        return CheckpointError(f"checkpoint {folder}: {name} is damaged: {what}{instead}")

    for path in sorted(folder.rglob("*")):
        if path.is_file():
            what = _damage(path)
            if what:
                raise damaged(str(path.relative_to(folder)), what)
    saved = json.loads(step_file.read_text(encoding="utf-8"))
    step = saved.get("step") if isinstance(saved, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise damaged("step.json", f"it holds {json.dumps(saved)[:60]}, not {{\"step\": N}} with N >= 0")
    named = _STEP_FOLDER.match(folder.name)
    if named and int(named.group(1)) != step:
        raise damaged("step.json", f"it says step {step}, and the folder is {folder.name}")
    return step


def load_checkpoint(accelerator, folder, data=None) -> int:
    """Restore a `save_checkpoint` folder into the prepared objects (and the position of a stream
    `data`); returns the step to continue from. A folder that is no checkpoint, a damaged file, or one
    that does not fit the prepared objects (another model, another number of processes) is a
    `CheckpointError` in one line."""
    folder = Path(folder)
    step = check_checkpoint(folder)
    try:
        accelerator.load_state(str(folder))
    except Exception as e:  # noqa: BLE001 - what accelerate, torch and safetensors raise is one line here
        raise CheckpointError(f"cannot resume from {folder}: {first_line(e)}") from None
    if data is not None and hasattr(data, "load_state_dict"):
        path = folder / f"data_state_{accelerator.process_index}.json"
        if not path.exists():
            raise CheckpointError(f"{folder} has no stream position for process {accelerator.process_index} "
                                  "(saved with other data or another number of processes)")
        data.load_state_dict(json.loads(path.read_text(encoding="utf-8")))
    return step


# ---------------------------------------------------------------------------------------------
# The run's log


class RunLog:
    """OUTPUT/log.jsonl: one JSON record per finished step, at most one per step, in step order.

    A run resumed from step s trains the steps after s again. Their new records replace the earlier run's
    records of the same steps as they are written, so a resume from an older checkpoint never duplicates a
    step; the earlier run's records of the steps not yet trained again stay until they are (they belong to
    its later checkpoints, which stay too). Appending is the common case; a replacement rewrites the log
    into a temporary file renamed over it. A last line cut short by a killed process is dropped.
    """

    def __init__(self, path):
        self.path = Path(path)
        self._last = 0  # the highest step in the file
        if self.path.exists():
            lines = self._read()
            self._last = max((step for step, _ in lines if step is not None), default=0)
            if self.path.read_bytes()[-1:] not in (b"", b"\n"):  # a torn last line
                self._rewrite(lines)

    def _read(self) -> list[tuple[int | None, str]]:
        text = self.path.read_text(encoding="utf-8")
        lines = text.splitlines()
        if lines and not text.endswith("\n"):
            lines.pop()  # cut short by a killed process
        out = []
        for line in lines:
            try:
                record = json.loads(line)
                step = record.get("step") if isinstance(record, dict) else None
            except ValueError:
                step = None  # not ours to judge: kept as it is
            out.append((step if isinstance(step, int) else None, line))
        return out

    def _rewrite(self, lines: list[tuple[int | None, str]]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.incomplete-{os.getpid()}")
        with full_disk_is_one_line(self.path.parent, f"rewriting {self.path.name}"):
            try:
                tmp.write_text("".join(line + "\n" for _, line in lines), encoding="utf-8")
                os.replace(tmp, self.path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

    def write(self, record: dict) -> None:
        line, step = json.dumps(record), record["step"]
        if step > self._last:
            # a line cut short by a full disk is dropped when the log is next read (`_read`)
            with full_disk_is_one_line(self.path.parent, f"writing {self.path.name}"), \
                    open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
            self._last = step
            return
        lines = [(s, text) for s, text in self._read() if s != step]
        at = next((i for i, (s, _) in enumerate(lines) if s is not None and s > step), len(lines))
        lines.insert(at, (step, line))
        self._rewrite(lines)


# ---------------------------------------------------------------------------------------------
# Ctrl-C


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during a run; the message is the one line to print (`reporting_interruption`)."""


def interruption_message(output_dir) -> str:
    latest = latest_checkpoint(output_dir)
    if latest is None:
        return f"interrupted; no checkpoint is complete yet in {Path(output_dir) / 'checkpoints'}"
    return f"interrupted; the last complete checkpoint is {latest} (--resume latest continues from it)"


@contextlib.contextmanager
def reporting_interruption(output_dir) -> Iterator[None]:
    """Inside the block, Ctrl-C and SIGTERM raise `Interrupted`, whose message names the last complete
    checkpoint of the run in `output_dir`. Everything the block was writing unwinds first (staging folders
    are removed; `final/` and the checkpoints stay as they were)."""
    with sigterm_as_interrupt():
        try:
            yield
        except Interrupted:
            raise
        except KeyboardInterrupt:
            raise Interrupted(interruption_message(output_dir)) from None

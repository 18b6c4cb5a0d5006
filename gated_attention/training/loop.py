"""A small training and evaluation loop shared by `gated-attention quickstart` and `examples/`.

Three choices matter for gated models and are made here once:

- **Gate parameters get their own learning rate** (`optimizer_groups`): any
  parameter whose name contains `attn_gate`. A converted model starts with its
  gates at weight 0 (score exactly 0.5); with the small learning rate usual for
  continued pretraining those gates may barely move (issue #10 of the Gated Attention paper's
  official repository),
  so new gate parameters can train at a from-scratch rate while the rest of the
  model keeps a continued-pretraining rate.
- **The mean gate score is logged** (`GateScoreMeter`), from the training
  forward passes themselves, so one can see whether the gates learn.
- **The data order is a pure function of (seed, step)** (`StepBatches`), so a
  run resumed at step s sees exactly the batches the uninterrupted run saw,
  without replaying a data loader; each logged step carries a digest of its
  batch to check that. A streamed corpus (`streaming.PackedStream`) is read in
  order instead; its position is saved with each checkpoint, so a resume
  continues at the next unseen batch just the same (`StreamBatches`).

`train` runs single-process or under `accelerate` (pass the `Accelerator`
after `prepare`-ing model, optimizer and scheduler).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..configuration.gate_spec import GATE_NAME as GATE_KEY
from ..modeling.attention import GATE_CLASSES
from .folders import full_disk_is_one_line, staged_output


def is_gate_parameter(name: str) -> bool:
    return GATE_KEY in name


def optimizer_groups(model: nn.Module, lr: float, gate_lr: float, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices only, and `gate_lr` for every `attn_gate` parameter.

    Empty groups are dropped (a model without gates has no gate group).
    """
    groups = {
        ("other", True): {"params": [], "lr": lr, "weight_decay": weight_decay, "name": "decay"},
        ("other", False): {"params": [], "lr": lr, "weight_decay": 0.0, "name": "no_decay"},
        ("gate", True): {"params": [], "lr": gate_lr, "weight_decay": weight_decay, "name": "gate"},
        ("gate", False): {"params": [], "lr": gate_lr, "weight_decay": 0.0, "name": "gate_no_decay"},
    }
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        kind = "gate" if is_gate_parameter(name) else "other"
        groups[(kind, p.ndim >= 2)]["params"].append(p)
    return [g for g in groups.values() if g["params"]]


def make_optimizer(model: nn.Module, lr: float, gate_lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    return torch.optim.AdamW(optimizer_groups(model, lr, gate_lr, weight_decay), betas=(0.9, 0.95), eps=1e-8)


def make_scheduler(optimizer, total_steps: int, warmup_steps: int, min_ratio: float = 0.1):
    """Linear warmup, then cosine decay to `min_ratio` of each group's learning rate."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# The modules whose output is the gate's logits, by name: a remote-code copy has its own classes.
GATE_MODULES = tuple(c.__name__ for c in GATE_CLASSES)


def gate_modules(model: nn.Module) -> list[nn.Module]:
    """The gate modules of a model (ours or a remote-code copy of it; PEFT copies included)."""
    return [m for m in model.modules() if type(m).__name__ in GATE_MODULES]


def gate_parameters_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if is_gate_parameter(n)}


class GateScoreMeter(contextlib.AbstractContextManager):
    """Averages the gate scores of every forward pass while active.

    Hooks every gate module (`GATE_MODULES`); `pop()` returns the mean score since the last
    call (NaN when no gate ran: an ungated model). The hooks are removed on exit.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._handles: list = []
        self._sum = 0.0
        self._count = 0

    def _hook(self, module, args, output):
        self._sum += float(module.gate_scores(output.detach().float()).mean())  # the module returns logits
        self._count += 1

    def __enter__(self) -> GateScoreMeter:
        self._handles = [m.register_forward_hook(self._hook) for m in gate_modules(self.model)]
        return self

    def __exit__(self, *exc_info) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def pop(self) -> float:
        value = self._sum / self._count if self._count else float("nan")
        self._sum, self._count = 0.0, 0
        return value


class StepBatches:
    """Row indices of the global batch of every optimizer step, a pure function of (seed, step).

    Epoch e is a fixed permutation of the rows (generator seeded with
    `seed * 1_000_003 + e`); step s takes the next `global_batch` rows, wrapping
    into the next epoch's permutation. A process reads its share with `shard`.
    """

    def __init__(self, num_rows: int, global_batch: int, seed: int):
        if num_rows < 1:
            raise ValueError("no training rows: the data is shorter than one sequence")
        self.num_rows, self.global_batch, self.seed = num_rows, global_batch, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.num_rows, generator=g)}
        return self._perms[epoch]

    def indices(self, step: int) -> torch.Tensor:
        start = step * self.global_batch
        out = []
        for i in range(start, start + self.global_batch):
            epoch, pos = divmod(i, self.num_rows)
            out.append(self._perm(epoch)[pos])
        return torch.stack(out)

    @staticmethod
    def digest(indices: torch.Tensor) -> str:
        return hashlib.sha1(indices.numpy().astype("int64").tobytes()).hexdigest()[:12]

    @staticmethod
    def shard(indices: torch.Tensor, micro_step: int, micro_batch: int, rank: int, world: int) -> torch.Tensor:
        """Rows of one process for one micro-step: micro-step-major, then rank."""
        start = (micro_step * world + rank) * micro_batch
        return indices[start : start + micro_batch]


class RowBatches:
    """Each step's micro-batches for this process from packed rows `[N, T]` (any row-indexable: a
    tensor, `streaming.TokenShards`), in the `StepBatches` order; the digest is of the global row indices."""

    def __init__(self, rows, batch_size: int, grad_accum: int, seed: int, rank: int = 0, world: int = 1):
        self.rows, self.batch_size, self.grad_accum, self.rank, self.world = rows, batch_size, grad_accum, rank, world
        self.order = StepBatches(len(rows), batch_size * grad_accum * world, seed)

    def step(self, step: int) -> tuple[list[torch.Tensor], str]:
        indices = self.order.indices(step)
        micro = [self.rows[StepBatches.shard(indices, m, self.batch_size, self.rank, self.world)]
                 for m in range(self.grad_accum)]
        return micro, StepBatches.digest(indices)


class StreamBatches:
    """Each step's micro-batches for this process from a `streaming.PackedStream`, read in order.

    Every process takes `batch_size * grad_accum` rows of its own part of the
    stream per step. The digest covers the whole global batch: a hash of each
    process's micro-batch tokens, gathered (rank-major), hashed again.
    """

    def __init__(self, stream, batch_size: int, grad_accum: int, accelerator=None):
        self.stream, self.batch_size, self.grad_accum, self.accelerator = stream, batch_size, grad_accum, accelerator

    def step(self, step: int) -> tuple[list[torch.Tensor], str]:
        from .streaming import rows_digest

        micro = [self.stream.next_rows(self.batch_size) for _ in range(self.grad_accum)]
        local = torch.tensor([rows_digest(x) for x in micro], dtype=torch.int64)  # [A]
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            local = self.accelerator.gather(local.to(self.accelerator.device)).cpu()  # [world * A]
        return micro, hashlib.sha1(local.numpy().tobytes()).hexdigest()[:12]


@dataclass
class TrainConfig:
    steps: int
    batch_size: int  # sequences per process and micro-step
    lr: float
    gate_lr: float
    grad_accum: int = 1
    weight_decay: float = 0.1
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    seed: int = 0
    log_every: int = 10
    # Forward passes run under `torch.autocast(device, autocast_dtype)` (e.g. bf16 on a GPU); the parameters,
    # their gradients and the optimizer state stay in their own dtype. None: no autocast.
    autocast_dtype: torch.dtype | None = None


def _reduce_mean(value: float, accelerator) -> float:
    if accelerator is None or accelerator.num_processes == 1:
        return value
    t = torch.tensor([value], device=accelerator.device)
    return float(accelerator.reduce(t, reduction="mean"))


def train(
    model: nn.Module,
    rows,
    config: TrainConfig,
    optimizer,
    scheduler,
    *,
    accelerator=None,
    start_step: int = 0,
    on_step: Callable[[int, dict], None] | None = None,
    desc: str = "train",
    progress: bool = True,
    bar=None,
) -> list[dict]:
    """Train on packed `rows` `[N, T]` (labels = inputs) for steps `start_step .. config.steps - 1`.

    `rows` is a tensor or another row-indexable (`streaming.TokenShards`), read
    in the `StepBatches` order, or a `streaming.PackedStream`, read in order from
    its current position (`load_checkpoint` restores it on resume).

    Returns one record per step: `step` (1-based count of finished steps),
    `loss` (mean over the global batch), `gate_score` (mean score during the
    step; NaN without gates), the learning rates the step used, `batch` (digest of the
    step's global row indices) and `seconds`. `on_step(step, record)` runs
    after each step (checkpointing, logging).

    The progress bar (`desc`, shown with `progress` on the first process) is closed when `train` returns or
    raises. A caller that trains in chunks passes its own `bar` (a tqdm bar over all its steps) instead, which
    `train` advances and leaves open, so the run shows one bar.
    """
    from tqdm.auto import tqdm

    rank = accelerator.process_index if accelerator else 0
    world = accelerator.num_processes if accelerator else 1
    device = accelerator.device if accelerator else next(model.parameters()).device
    if hasattr(rows, "next_rows"):  # a stream
        batches = StreamBatches(rows, config.batch_size, config.grad_accum, accelerator)
    else:
        batches = RowBatches(rows, config.batch_size, config.grad_accum, config.seed, rank, world)
    history = []
    show = progress and rank == 0
    device_type = torch.device(device).type

    def autocast():
        if config.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=config.autocast_dtype)

    if bar is None:  # this call's own, closed when the block ends, whether it returns or raises
        opened = tqdm(total=config.steps, initial=start_step, desc=desc, disable=not show, dynamic_ncols=True, leave=False)
    else:  # the caller's, which it closes
        opened = contextlib.nullcontext(bar)
    model.train()
    with opened as bar, GateScoreMeter(model) as meter:
        t0 = time.perf_counter()
        for step in range(start_step, config.steps):
            micro_batches, digest = batches.step(step)
            total = 0.0
            for micro, x in enumerate(micro_batches):
                x = x.to(device)
                last = micro == config.grad_accum - 1
                sync = contextlib.nullcontext() if (accelerator is None or last) else accelerator.no_sync(model)
                with sync:
                    with autocast():  # the forward only: backward runs each op in its forward's dtype anyway
                        loss = model(input_ids=x, labels=x).loss / config.grad_accum
                    (accelerator.backward(loss) if accelerator else loss.backward())
                total += float(loss.detach())
            if config.max_grad_norm:
                clip = accelerator.clip_grad_norm_ if accelerator else torch.nn.utils.clip_grad_norm_
                clip(model.parameters(), config.max_grad_norm)
            lrs = {g.get("name", str(i)): g["lr"] for i, g in enumerate(optimizer.param_groups)}  # this step's
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            record = {
                "step": step + 1,
                "loss": _reduce_mean(total, accelerator),
                "gate_score": _reduce_mean(meter.pop(), accelerator),
                "lr": lrs.get("decay", lrs.get("no_decay", float("nan"))),  # NaN: the gates train alone
                "gate_lr": lrs.get("gate", lrs.get("gate_no_decay", float("nan"))),
                "batch": digest,
                "seconds": time.perf_counter() - t0,
            }
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"loss became {record['loss']} at step {step + 1}")
            history.append(record)
            bar.update(1)
            if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                post = {"loss": f"{record['loss']:.3f}"}
                if not math.isnan(record["gate_score"]):
                    post["gate"] = f"{record['gate_score']:.3f}"
                bar.set_postfix(post)
            if on_step is not None:
                on_step(step + 1, record)
    return history


@torch.no_grad()
def evaluate_loss(model: nn.Module, rows: torch.Tensor, batch_size: int, accelerator=None) -> float:
    """Mean next-token loss (nats) over all predicted tokens of `rows` `[N, T]`.

    Under accelerate each process takes every world-th batch and the sums are
    reduced. Every process runs the same number of forward passes (a process
    short of a batch repeats the first one and does not count it): DDP and FSDP
    forwards are collective operations.
    """
    rank = accelerator.process_index if accelerator else 0
    world = accelerator.num_processes if accelerator else 1
    device = accelerator.device if accelerator else next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    num_batches = math.ceil(len(rows) / batch_size)
    for j in range(math.ceil(num_batches / world)):
        i = j * world + rank
        counted = i < num_batches
        start = i * batch_size if counted else 0
        x = rows[start : start + batch_size].to(device)
        logits = model(input_ids=x).logits[:, :-1].float()  # [B, T-1, V]
        if counted:
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            loss_sum += loss.double()
            count += x[:, 1:].numel()
    if accelerator is not None and world > 1:
        loss_sum, count = accelerator.reduce(loss_sum, "sum"), accelerator.reduce(count, "sum")
    model.train(was_training)
    return float(loss_sum / count)


# ---------------------------------------------------------------------------------------------
# accelerate: the final save (used by examples/; checkpoints and resume are in `checkpoints`)


def check_finite_weights(model: nn.Module, accelerator=None, *, step: int | None = None, saving: str = "the model") -> None:
    """FloatingPointError (one line naming the step and a parameter) if any weight is NaN or inf.

    Run before every save: a diverged step (too high a learning rate) can leave a finite loss and
    non-finite weights, and a saved model of NaNs looks like any other. Every process checks its own
    part (FSDP shards) and the verdict is summed, so all of them raise together.
    """
    bad = None
    for name, p in model.named_parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard
        if t.numel() and not bool(torch.isfinite(t).all()):
            bad = name
            break
    verdict = torch.tensor([0 if bad is None else 1])
    if accelerator is not None and accelerator.num_processes > 1:
        verdict = accelerator.reduce(verdict.to(accelerator.device), reduction="sum").cpu()
    if int(verdict.item()):
        after = "" if step is None else f" after step {step}"
        where = f" ({bad})" if bad else " (on another process)"
        raise FloatingPointError(f"the weights are not finite (NaN or inf){after}{where}: {saving} was not saved; "
                                 "the run diverged (a lower --lr or --max-grad-norm?)")


def save_final(accelerator, model, folder, tokenizer=None, *, step: int | None = None, card=None) -> None:
    """`save_pretrained` of the unwrapped model with the full state dict (DDP and FSDP alike).

    Our models' `save_pretrained` writes the remote-code bundle beside the weights; `card(stage)`, if given,
    writes the model card (`hub.model_card.write_training_card`). Weights that are not finite are refused
    (`check_finite_weights`; `step` names the step in the message). The folder is written as
    `.NAME.incomplete-PID` beside `folder` and renamed to it when whole (`folders.staged_output`).
    """
    folder = Path(folder)
    check_finite_weights(model, accelerator, step=step, saving=f"{folder.name}/")
    state_dict = accelerator.get_state_dict(model)  # collective under FSDP: every process calls it
    if accelerator.is_main_process:
        with full_disk_is_one_line(folder.parent, f"saving {folder.name}/"), staged_output(folder) as stage:
            accelerator.unwrap_model(model).save_pretrained(stage, state_dict=state_dict)
            if tokenizer is not None:
                tokenizer.save_pretrained(stage)
            if card is not None:
                card(stage)
    accelerator.wait_for_everyone()


def finish_training(accelerator) -> None:
    """`accelerator.end_training()` (which destroys the process group), after the DDP/FSDP wrappers are gone.

    A DDP wrapper's Reducer holds the process group. Freed after the group is
    destroyed, it is the group's last owner, and its destructor (which does not
    release the GIL) joins gloo's worker threads while one of them may need the
    GIL to free a finished collective's tensors: the process hangs at exit (1 in
    25 two-process runs on a loaded 2-core machine; pytorch/pytorch#56297). So
    accelerate's own references to the prepared objects are dropped first, while
    the group lives. Callers drop theirs before calling: `model =
    accelerator.unwrap_model(model)`.
    """
    accelerator.wait_for_everyone()
    accelerator.free_memory()  # accelerate's references to prepared models, optimizers, schedulers
    gc.collect()
    accelerator.end_training()


def with_rope(model, rope_parameters: dict, max_position_embeddings: int):
    """A copy of `model` (same weights) whose rotary tables are rebuilt for other `rope_parameters`.

    Build `rope_parameters` with `gated_attention.convert.rope.apply_rope_change`.
    """
    config = copy.deepcopy(model.config)
    config.rope_parameters, config.max_position_embeddings = rope_parameters, max_position_embeddings
    other = type(model)(config)
    other.load_state_dict(model.state_dict())
    return other.to(next(model.parameters()).device).eval()

"""Run serving engines on checkpoints, greedily, from token ids: the engine side of `serving_check.py`.

    ENGINE_PYTHON benchmarks/serving_engines.py {vllm|llama.cpp|mlx-lm} JOBS.json RESULTS.json

Runs in the engine's own environment (vLLM and llama-cpp-python each pin their
own torch / build; mlx-lm has no torch), so it imports only the standard library and the engine,
never this package: a checkpoint's remote code is all vLLM needs. JOBS.json
holds `{"jobs": [{"name", "path", "prompts": [[token ids]], "max_tokens",
"dtype", "model_impl", "tensor_parallel_size", "texts"}]}`; RESULTS.json gets one record per job with
the greedy tokens, the log-probability of each chosen token, the engine's own
tokenization of `texts`, load and generate seconds, or the first line of the
error that stopped it. A vLLM job with `decode_tokens` is timed instead
(`quantized_serving.py`): its record holds decode tokens/s and load seconds.
Every job runs in a fresh child process, so an engine that aborts
(llama.cpp's GGML_ASSERT) costs that job only.

`benchmarks/gguf_quant.py` runs two more kinds in the llama-cpp-python
environment the same way: `llama.cpp-quantize` (llama-quantize's function on a
GGUF, jobs `{"name", "path", "out", "type"}`) and `llama.cpp-logits` (every
position's logits of each prompt, saved to the job's `out` as `.npy`).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue as queues
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request


def cpu_thread_binding(ranks: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `ranks` CPU workers: this process's cores split into one list per rank.

    vLLM's CPU backend binds each worker to a NUMA node by default and refuses
    tensor parallelism on a machine with fewer nodes than ranks ("Not enough
    allowed NUMA nodes"); explicit core lists, `0|1` for two ranks on two
    cores, work on any machine.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        return "nobind"
    per_rank = len(cores) // ranks
    return "|".join(",".join(map(str, cores[r * per_rank : (r + 1) * per_rank])) for r in range(ranks))


def run_vllm(job: dict) -> dict:
    tp = job.get("tensor_parallel_size", 1)
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tp)  # read only by the CPU backend
    if job.get("server"):
        return run_vllm_server(job)
    if job.get("decode_tokens"):
        return time_vllm_decode(job)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = vllm_engine(job)
    t1 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], logprobs=1, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    t2 = time.perf_counter()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, ids)] for o, ids in zip(outputs, tokens)]
    tokenizer = llm.get_tokenizer()
    tokenized = [tokenizer.encode(text, add_special_tokens=False) for text in job.get("texts", [])]
    return {"tokens": tokens, "logprobs": logprobs, "tokenized": tokenized, "load_s": t1 - t0, "generate_s": t2 - t1}


def vllm_engine(job: dict, **settings):
    """vLLM's offline engine on the job's checkpoint, remote code trusted, with a small KV cache."""
    from vllm import LLM

    return LLM(
        model=job["path"], model_impl=job.get("model_impl", "auto"), trust_remote_code=True, dtype=job["dtype"],
        max_model_len=job["max_model_len"], seed=0, enforce_eager=job.get("enforce_eager", True),
        tensor_parallel_size=job.get("tensor_parallel_size", 1),
        kv_cache_memory_bytes=256 << 20,  # tiny models: the CPU backend otherwise reserves most of RAM
        **settings,
    )


def time_vllm_decode(job: dict) -> dict:
    """Decode tokens/s at batch 1 (`benchmarks/quantized_serving.py`): `decode_tokens` over the time generating
    1 + `decode_tokens` tokens from the first prompt takes beyond generating 1 (the prefill and its token), each the
    fastest of `repeats` interleaved runs after one warm-up. Prefix caching is off, so every run prefills."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = vllm_engine(job, enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    prompt = [TokensPrompt(prompt_token_ids=job["prompts"][0])]

    def seconds(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - start

    n = job["decode_tokens"]
    seconds(n + 1)
    first, whole = [], []
    for _ in range(job.get("repeats", 3)):
        first.append(seconds(1))
        whole.append(seconds(n + 1))
    return {"decode_tok_s": n / (min(whole) - min(first)), "load_s": load_s, "first_token_s": min(first),
            "generate_s": min(whole)}


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def run_vllm_server(job: dict) -> dict:
    """vLLM's OpenAI-compatible server on 127.0.0.1, queried over HTTP as a client would.

    Started as `python -m vllm.entrypoints.openai.api_server` (the `vllm serve`
    command of vllm-cpu 0.32 asks for the metadata of a distribution named
    `vllm` and fails), in this process group, so `run_job` ends it with the job.
    """
    with socket.socket() as probe:  # a free port on the loopback interface
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", job["path"], "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "model", "--model-impl", job.get("model_impl", "auto"),
           "--trust-remote-code", "--dtype", job["dtype"], "--max-model-len", str(job["max_model_len"]),
           "--seed", "0", "--kv-cache-memory-bytes", str(256 << 20), "--return-tokens-as-token-ids",
           "--tensor-parallel-size", str(job.get("tensor_parallel_size", 1))]
    if job.get("enforce_eager", True):
        cmd.append("--enforce-eager")
    log = tempfile.TemporaryFile(mode="w+")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.perf_counter()
    try:
        while True:  # up when /health answers 200
            if server.poll() is not None:
                log.seek(0)
                last = [line for line in log.read().splitlines() if line.strip()][-1:] or ["(no output)"]
                raise RuntimeError(f"the server exited with code {server.returncode}: {last[0]}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError):
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            time.sleep(1)
        t1 = time.perf_counter()
        tokens, logprobs = [], []
        for prompt in job["prompts"]:
            choice = _post(f"{base}/v1/completions", {
                "model": "model", "prompt": prompt, "max_tokens": job["max_tokens"], "temperature": 0,
                "logprobs": 1, "ignore_eos": True})["choices"][0]
            # --return-tokens-as-token-ids: each token is "token_id:<id>"
            tokens.append([int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]])
            logprobs.append(choice["logprobs"]["token_logprobs"])
        t2 = time.perf_counter()
        tokenized = [_post(f"{base}/tokenize", {"model": "model", "prompt": text, "add_special_tokens": False})["tokens"]
                     for text in job.get("texts", [])]
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(30)
    return {"tokens": tokens, "logprobs": logprobs, "tokenized": tokenized, "load_s": t1 - t0, "generate_s": t2 - t1}


def run_llama_cpp(job: dict) -> dict:
    import llama_cpp
    import numpy as np  # a dependency of llama-cpp-python

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=job["path"], n_ctx=job["max_model_len"], logits_all=True, verbose=False,
                          seed=0, n_threads=job.get("threads"))
    t1 = time.perf_counter()
    tokens, logprobs = [], []
    for prompt in job["prompts"]:
        llm.reset()
        llm.eval(prompt)
        ids, lps = [], []
        for _ in range(job["max_tokens"]):  # greedy from the raw logits, as transformers' generate does
            logits = llm.scores[llm.n_tokens - 1].astype(np.float64)  # [V]
            best = int(logits.argmax())
            ids.append(best)
            lps.append(float(logits[best] - logits.max() - np.log(np.exp(logits - logits.max()).sum())))
            llm.eval([best])
        tokens.append(ids)
        logprobs.append(lps)
    t2 = time.perf_counter()
    tokenized = [llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) for text in job.get("texts", [])]
    return {"tokens": tokens, "logprobs": logprobs, "tokenized": tokenized, "load_s": t1 - t0, "generate_s": t2 - t1}


def run_llama_cpp_quantize(job: dict) -> dict:
    """llama-quantize's own function (`llama_model_quantize`, default parameters, no importance matrix) on a GGUF:
    `job["path"]` -> `job["out"]` as `job["type"]` (a `LLAMA_FTYPE_MOSTLY_*` suffix, e.g. Q4_K_M). llama.cpp's
    log during the call (its stderr) is kept, and its warnings returned: they name the tensors that fell back."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{job['type']}")
    params.nthread = job.get("threads") or 0  # 0: llama.cpp's own choice, the hardware's threads
    t0 = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+b") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)  # llama.cpp writes its log to the process's stderr, one line per tensor
        try:
            code = llama_cpp.llama_model_quantize(job["path"].encode(), job["out"].encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        lines = log.read().decode("utf-8", "replace").splitlines()
    if code != 0:
        raise RuntimeError(f"llama_model_quantize returned {code}: {(lines or ['(no log)'])[-1].strip()}")
    warnings = [" ".join(line.split()) for line in lines if "warning" in line.lower() or "fallback" in line.lower()]
    return {"seconds": time.perf_counter() - t0, "bytes": os.path.getsize(job["out"]), "warnings": warnings}


def run_llama_cpp_logits(job: dict) -> dict:
    """Every position's logits of each prompt (`logits_all`), from a fresh state per prompt, saved to
    `job["out"]` as float32 `[prompts, T, V]` (prompts of one length T)."""
    import llama_cpp
    import numpy as np  # a dependency of llama-cpp-python

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=job["path"], n_ctx=job["max_model_len"], n_batch=job["max_model_len"],
                          logits_all=True, verbose=False, seed=0, n_threads=job.get("threads"))
    t1 = time.perf_counter()
    prompts = job["prompts"]
    logits = np.empty((len(prompts), len(prompts[0]), llm.n_vocab()), dtype=np.float32)  # [N, T, V]
    for i, ids in enumerate(prompts):
        llm.reset()
        llm.eval(ids)
        logits[i] = llm.scores[: len(ids)]
    np.save(job["out"], logits)
    return {"load_s": t1 - t0, "eval_s": time.perf_counter() - t1}


def run_mlx_lm(job: dict) -> dict:
    """mlx-lm's own load and greedy `generate_step` (what `mlx_lm.generate` runs), from token ids.

    bf16 is cast as `mlx_lm.convert --dtype bfloat16` casts: every floating parameter its model allows
    (Qwen3.5 keeps `A_log` as stored). The tokenizer is the one `mlx_lm.load` gives the folder.
    """
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    model, tokenizer = load(job["path"])
    if job["dtype"] == "bfloat16":
        keep = getattr(model, "cast_predicate", lambda _: True)
        model.update(tree_map_with_path(
            lambda k, v: v.astype(mx.bfloat16) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
    mx.eval(model.parameters())
    t1 = time.perf_counter()
    tokens, logprobs = [], []
    for prompt in job["prompts"]:  # greedy is generate_step's default sampler; it never stops at EOS itself
        ids, lps = [], []
        for token, step in generate_step(mx.array(prompt), model, max_tokens=job["max_tokens"]):
            ids.append(int(token))
            lps.append(step[int(token)].astype(mx.float32).item())
        tokens.append(ids)
        logprobs.append(lps)
    t2 = time.perf_counter()
    tokenized = [tokenizer.encode(text, add_special_tokens=False) for text in job.get("texts", [])]
    return {"tokens": tokens, "logprobs": logprobs, "tokenized": tokenized, "load_s": t1 - t0, "generate_s": t2 - t1}


RUNNERS = {"vllm": run_vllm, "llama.cpp": run_llama_cpp, "mlx-lm": run_mlx_lm,
           # benchmarks/gguf_quant.py: llama-quantize, and the logits its perplexity is computed from
           "llama.cpp-quantize": run_llama_cpp_quantize, "llama.cpp-logits": run_llama_cpp_logits}


def _child(engine: str, job: dict, queue) -> None:
    os.setpgrp()  # the engine's own processes (vLLM's engine core and workers) join this group: see run_job
    try:
        queue.put({"ok": True, **RUNNERS[engine](job)})
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        text = "".join(traceback.format_exception_only(type(e), e)).strip()
        queue.put({"ok": False, "error": " ".join(text.split())[:400]})  # one line


def run_job(engine: str, job: dict, timeout: float) -> dict:
    ctx = multiprocessing.get_context("spawn")  # vLLM starts its engine core with spawn too
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(engine, job, queue))
    proc.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = queue.get(timeout=1)
            break
        except queues.Empty:
            if not proc.is_alive():  # it died without a word: an abort (llama.cpp's GGML_ASSERT) or a kill
                result = {"ok": False, "error": f"the engine process ended with exit code {proc.exitcode} and no result"}
                break
            if time.monotonic() > deadline:
                result = {"ok": False, "error": f"no result within {timeout:.0f} s"}
                break
    # vLLM's engine core and workers outlive the process that made them (they poll, busy, for minutes):
    # end the whole process group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.join(10)
    return {"name": job["name"], **result}


def main(argv: list[str]) -> int:
    engine, jobs_path, results_path = argv
    jobs = json.loads(open(jobs_path, encoding="utf-8").read())["jobs"]
    results = []
    for job in jobs:
        print(f"{engine}: {job['name']} ...", file=sys.stderr, flush=True)
        results.append(run_job(engine, job, timeout=job.get("timeout", 900)))
        with open(results_path, "w", encoding="utf-8") as f:  # after every job: a killed run keeps what it has
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

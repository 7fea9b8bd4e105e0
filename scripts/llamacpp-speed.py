#!/usr/bin/env python3
"""kvsan's engine against llama.cpp on the default model, shape by shape, in one run.

Same file, same token ids (benches/model.rs's LCG), same shapes, 2 threads
each, the two run alternately (which goes first alternates by round):

    pp:512        a 512-token prompt in one batch                  (prompt tokens/s)
    tg:128        128 greedy decode steps after a 16-token prompt  (generated tokens/s)
    prefill:N     an N-token prompt in batches of 512, N = 1k, 4k, 8k
    decode:N      32 greedy decode steps after an N-token prompt (N = 1k, 4k, and
                  8160: the model's 8,192 positions less the 32 steps)
    batch:N       N sequences decoding 64 steps each, one batch a step (N = 1, 4, 16)

kvsan's side is `cargo bench --bench model` with KVSAN_BENCH_SHAPE (built
once, run as a process per measure); llama.cpp's is llama-cpp-python in this
process (its batched decode through the library's own batch API, one sequence
id per row, as llama-batched-bench does). Prints, per shape, each side's median
tokens/s and the median of the per-round ratios kvsan ÷ llama.cpp (above 1:
kvsan is faster), then llama.cpp's own system line (the instructions its
build uses).

Needs llama-cpp-python, built for this machine for a fair comparison:

    CMAKE_ARGS="-DGGML_NATIVE=ON" python3 -m pip install llama-cpp-python==0.3.36

    python3 scripts/llamacpp-speed.py [--model PATH] [--runs N] [--threads N] [--shapes a,b,...]

The model defaults to the one `scripts/fetch-model` keeps in the cache.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SHAPES = [
    "pp:512",
    "tg:128",
    "prefill:1024",
    "prefill:4096",
    "prefill:8192",
    "decode:1024",
    "decode:4096",
    "decode:8160",
    "batch:1",
    "batch:4",
    "batch:16",
]


def tokens(n, seed):
    """The bench's deterministic token ids (benches/common/mod.rs `tokens`)."""
    mask = (1 << 64) - 1
    x = seed
    out = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) & mask
        out.append(100 + (x >> 33) % 40000)
    return out


def default_model():
    path = (
        subprocess.run(
            ["bash", os.path.join(HERE, "fetch-model")],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    return path


def kvsan_bench_binary():
    """Builds `benches/model.rs` once; its executable."""
    out = subprocess.run(
        ["cargo", "bench", "--bench", "model", "--no-run", "--message-format=json"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for line in out.splitlines():
        msg = json.loads(line)
        if (
            msg.get("reason") == "compiler-artifact"
            and msg["target"]["name"] == "model"
            and msg.get("executable")
        ):
            return msg["executable"]
    sys.exit("cargo built no `model` bench")


def kvsan_run(binary, shape, threads):
    env = dict(os.environ, KVSAN_BENCH_SHAPE=shape, KVSAN_THREADS=str(threads))
    out = subprocess.run(
        [binary, "--bench"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for line in out.splitlines():
        if line.startswith(shape + " "):
            return float(line.split()[1])
    sys.exit(f"the bench printed no {shape} line:\n{out}")


class LlamaCpp:
    """llama.cpp through llama-cpp-python, one context per shape's size."""

    def __init__(self, model, threads):
        self.model, self.threads = model, threads
        self.contexts = {}

    def llm(self, n_ctx, n_batch):
        from llama_cpp import Llama

        key = (n_ctx, n_batch)
        if key not in self.contexts:
            self.contexts[key] = Llama(
                model_path=self.model,
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_ubatch=n_batch,
                n_threads=self.threads,
                n_threads_batch=self.threads,
                verbose=False,
            )
        return self.contexts[key]

    def run(self, shape):
        kind, n = shape.split(":")
        n = int(n)
        if kind == "pp":
            llm = self.llm(max(1024, n + 64), n)
            return self.timed_eval(llm, tokens(n, 1))
        if kind == "prefill":
            llm = self.llm(n, 512)
            return self.timed_eval(llm, tokens(n, 1))
        if kind == "tg":
            return self.decode(self.llm(1024, 512), 16, n)
        if kind == "decode":
            return self.decode(self.llm(n + 32, 512), n, 32)
        if kind == "batch":
            return self.batched(n, 64)
        sys.exit(f"unknown shape {shape}")

    @staticmethod
    def timed_eval(llm, prompt):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        return len(prompt) / (time.perf_counter() - t)

    @staticmethod
    def decode(llm, context, steps):
        import llama_cpp as L
        import numpy as np

        vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(llm._model.model))

        def last_logits():
            row = L.llama_get_logits_ith(llm._ctx.ctx, -1)
            return np.ctypeslib.as_array(row, shape=(vocab,))

        llm.reset()
        llm.eval(tokens(context, 1))
        t = time.perf_counter()
        for _ in range(steps):
            llm.eval([int(last_logits().argmax())])
        return steps / (time.perf_counter() - t)

    def batched(self, n_seq, steps):
        import llama_cpp as L
        import numpy as np
        from llama_cpp import _internals

        prompt_len = 16
        base = self.llm(1024, 512)
        params = base.context_params
        params.n_ctx = max(1024, n_seq * (prompt_len + steps) + 64)
        params.n_seq_max = max(1, n_seq)
        params.kv_unified = True
        ctx = _internals.LlamaContext(model=base._model, params=params, verbose=False)
        try:
            vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(base._model.model))
            batch = L.llama_batch_init(n_seq * prompt_len, 0, 1)
            try:

                def decode(rows):
                    batch.n_tokens = len(rows)
                    for i, (tok, pos, seq, want) in enumerate(rows):
                        batch.token[i] = tok
                        batch.pos[i] = pos
                        batch.n_seq_id[i] = 1
                        batch.seq_id[i][0] = seq
                        batch.logits[i] = want
                    rc = L.llama_decode(ctx.ctx, batch)
                    if rc != 0:
                        sys.exit(f"llama_decode returned {rc}")

                def next_token(i):
                    row = L.llama_get_logits_ith(ctx.ctx, i)
                    return int(np.ctypeslib.as_array(row, shape=(vocab,)).argmax())

                rows = [
                    (t, p, s, p == prompt_len - 1)
                    for s in range(n_seq)
                    for p, t in enumerate(tokens(prompt_len, 1 + s))
                ]
                decode(rows)
                nxt = [
                    next_token(s * prompt_len + prompt_len - 1) for s in range(n_seq)
                ]
                t = time.perf_counter()
                for step in range(steps):
                    decode([(nxt[s], prompt_len + step, s, True) for s in range(n_seq)])
                    nxt = [next_token(s) for s in range(n_seq)]
                return n_seq * steps / (time.perf_counter() - t)
            finally:
                L.llama_batch_free(batch)
        finally:
            ctx.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the fetched default model)")
    ap.add_argument("--runs", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        sys.exit(
            'llama-cpp-python is not installed: CMAKE_ARGS="-DGGML_NATIVE=ON" '
            "python3 -m pip install llama-cpp-python==0.3.36"
        )
    model = args.model or default_model()
    shapes = args.shapes.split(",")
    binary = kvsan_bench_binary()
    llama = LlamaCpp(model, args.threads)
    llama.run("pp:64")  # warm-up: page in the weights
    ours = {s: [] for s in shapes}
    theirs = {s: [] for s in shapes}
    for r in range(args.runs):
        for shape in shapes:
            sides = [
                ("kvsan", lambda s=shape: kvsan_run(binary, s, args.threads)),
                ("llama.cpp", lambda s=shape: llama.run(s)),
            ]
            if r % 2:
                sides.reverse()
            for name, measure in sides:
                (ours if name == "kvsan" else theirs)[shape].append(measure())
            print(
                f"round {r + 1} {shape:<13} kvsan {ours[shape][-1]:>8.1f}  "
                f"llama.cpp {theirs[shape][-1]:>8.1f} tokens/s",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"{'shape':<13} {'kvsan tok/s':>12} {'llama.cpp tok/s':>16} {'kvsan ÷ llama.cpp':>18}   per round"
    )
    for shape in shapes:
        ratios = [a / b for a, b in zip(ours[shape], theirs[shape])]
        print(
            f"{shape:<13} {statistics.median(ours[shape]):>12.1f} "
            f"{statistics.median(theirs[shape]):>16.1f} {statistics.median(ratios):>18.2f}   "
            + " ".join(f"{x:.2f}" for x in ratios)
        )
    info = llama_cpp.llama_print_system_info()
    print("llama.cpp:", info.decode() if isinstance(info, bytes) else info)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""llama.cpp's speed on the default model, measured like `cargo bench --bench model`.

Same file, same token ids (the bench's LCG), same shapes: a 512-token prompt
in one batch, and 128 greedy decode steps after a 16-token prompt, batch 1,
2 threads. Prints one line per measure in the bench's format, so a session
can run both alternately and compare medians taken minutes apart.

Needs llama-cpp-python (`python3 -m pip install llama-cpp-python==0.3.36`
builds llama.cpp from source, about 15 minutes on 2 cores):

    python3 scripts/llamacpp-speed.py [--model PATH] [--runs N] [--threads N]

The model defaults to the one `scripts/fetch-model` keeps in the cache.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time


def tokens(n, seed):
    """The bench's deterministic token ids (benches/model.rs `tokens`)."""
    mask = (1 << 64) - 1
    x = seed
    out = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) & mask
        out.append(100 + (x >> 33) % 40000)
    return out


def default_model():
    here = os.path.dirname(os.path.abspath(__file__))
    path = subprocess.run(
        ["bash", os.path.join(here, "fetch-model")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip().splitlines()[-1]
    return path


def prompt_run(llm, n, seed):
    llm.reset()
    prompt = tokens(n, seed)
    t = time.perf_counter()
    llm.eval(prompt)
    return n / (time.perf_counter() - t)


def decode_run(llm, steps, seed):
    llm.reset()
    llm.eval(tokens(16, seed))
    t = time.perf_counter()
    for _ in range(steps):
        logits = llm.scores[llm.n_tokens - 1]
        llm.eval([int(logits.argmax())])
    return steps / (time.perf_counter() - t)


def report(name, runs):
    listed = " ".join(f"{r:.1f}" for r in runs)
    print(f"{name:<36} median {statistics.median(runs):>8.1f} tokens/s   runs: {listed}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the fetched default model)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit(
            "llama-cpp-python is not installed: python3 -m pip install llama-cpp-python==0.3.36"
        )
    model = args.model or default_model()
    llm = Llama(
        model_path=model,
        n_ctx=1024,
        n_batch=512,
        n_ubatch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    prompt_run(llm, 64, 0)  # warm-up, as the bench does
    report(
        "prompt processing, 512 tokens",
        [prompt_run(llm, 512, r) for r in range(args.runs)],
    )
    report(
        "decode, batch 1, 128 tokens",
        [decode_run(llm, 128, r) for r in range(args.runs)],
    )


if __name__ == "__main__":
    main()

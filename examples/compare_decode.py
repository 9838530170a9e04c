"""Side by side: the same workload against vLLM's stock decode and the rewriter.

Start two servers on the same GPUs in turn (or on two machines), e.g.

    vllm serve moonshotai/Kimi-K3 -tp 8 --port 8001                                   # auto
    vllm serve moonshotai/Kimi-K3 -tp 8 --port 8002 \\
        --additional-config '{"decode_backend": "latency_specialized"}'

then run vLLM's own benchmark client against both and compare:

    python examples/compare_decode.py --model moonshotai/Kimi-K3 \\
        --auto-url http://localhost:8001 --rewriter-url http://localhost:8002 \\
        --input-len 1024 --output-len 1000 --concurrency 1 --num-prompts 32

or compare result files that ``vllm bench serve --save-result`` already wrote:

    python examples/compare_decode.py --results auto.json rewriter.json

Reported as separate columns, never one blended number: decode tokens/s per request with
the prefill excluded ((output tokens - 1) / (latency - time to first token)), time to
first token, output throughput of the whole run, and request latency.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Summary:
    requests: int
    decode_tok_s_per_request: float  # median over requests, prefill excluded
    ttft_ms: float  # median
    output_tok_s: float  # whole run: all output tokens over the run's duration
    latency_ms: float  # median end-to-end request latency


def summarize(result: dict) -> Summary:
    """Numbers from one ``vllm bench serve --save-result`` JSON (per-request arrays in seconds)."""
    for key in ("ttfts", "latencies", "output_lens", "output_throughput"):
        if key not in result:
            raise ValueError(f"not a vllm bench serve result: missing {key!r}")
    ok = [i for i, err in enumerate(result.get("errors") or [""] * len(result["ttfts"])) if not err]
    if not ok:
        raise ValueError("the run has no successful request")
    decode_rates = []
    for i in ok:
        decode_tokens = result["output_lens"][i] - 1
        decode_time = result["latencies"][i] - result["ttfts"][i]
        if decode_tokens > 0 and decode_time > 0:
            decode_rates.append(decode_tokens / decode_time)
    if not decode_rates:
        raise ValueError("no request produced more than one token: decode speed is undefined")
    return Summary(
        requests=len(ok),
        decode_tok_s_per_request=statistics.median(decode_rates),
        ttft_ms=1000 * statistics.median(result["ttfts"][i] for i in ok),
        output_tok_s=float(result["output_throughput"]),
        latency_ms=1000 * statistics.median(result["latencies"][i] for i in ok),
    )


COLUMNS = (("decode tok/s/req", "decode_tok_s_per_request", True), ("TTFT ms", "ttft_ms", False),
           ("output tok/s", "output_tok_s", True), ("latency ms", "latency_ms", False))


def render(rows: dict[str, Summary]) -> str:
    """A table, one row per backend, plus the ratio of the last to the first (>1: better)."""
    head = f"{'backend':<22}{'requests':>9}" + "".join(f"{name:>18}" for name, _, _ in COLUMNS)
    lines = [head]
    for label, s in rows.items():
        lines.append(f"{label:<22}{s.requests:>9}" + "".join(f"{getattr(s, key):>18.2f}" for _, key, _ in COLUMNS))
    if len(rows) >= 2:
        first, last = list(rows.values())[0], list(rows.values())[-1]
        ratios = []
        for _, key, higher_better in COLUMNS:
            a, b = getattr(first, key), getattr(last, key)
            ratios.append(b / a if higher_better else a / b)
        lines.append(f"{'speedup (>1 better)':<22}{'':>9}" + "".join(f"{r:>17.2f}x" for r in ratios))
    return "\n".join(lines)


def run_client(url: str, args: argparse.Namespace, out: Path) -> dict:
    """One ``vllm bench serve`` run against ``url``; its saved result."""
    cmd = ["vllm", "bench", "serve", "--base-url", url, "--model", args.model, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--ignore-eos", "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", nargs=2, type=Path, metavar=("AUTO_JSON", "REWRITER_JSON"),
                   help="compare two saved vllm bench serve results")
    p.add_argument("--auto-url")
    p.add_argument("--rewriter-url")
    p.add_argument("--model")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=32)
    args = p.parse_args(argv)
    if args.results:
        results = [json.loads(path.read_text()) for path in args.results]
    elif args.auto_url and args.rewriter_url and args.model:
        tmp = Path(tempfile.mkdtemp(prefix="k3-compare-"))
        results = [run_client(args.auto_url, args, tmp / "auto.json"),
                   run_client(args.rewriter_url, args, tmp / "rewriter.json")]
    else:
        p.error("give --results AUTO REWRITER, or --auto-url, --rewriter-url and --model")
    print(render({"auto (stock)": summarize(results[0]), "latency_specialized": summarize(results[1])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

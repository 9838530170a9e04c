"""Serve Kimi K3 with the rewriter's decode path, offline (the server form is below).

    pip install -e '.[vllm]'                  # vllm==0.33.0 and this package's plugin
    python examples/serve_kimi_k3.py --model moonshotai/Kimi-K3 --tp 8
    python examples/serve_kimi_k3.py --model moonshotai/Kimi-K3 --tp 8 --decode-backend auto   # stock, to compare

The server equivalent:

    vllm serve moonshotai/Kimi-K3 -tp 8 --additional-config '{"decode_backend": "latency_specialized"}'

The plugin is found by vLLM through its entry point; nothing needs importing. At startup
the log says which decode path is active, which layers were rewritten (and why any was
not), and at shutdown how many steps took each path.
"""
import argparse

from vllm import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--decode-backend", default="latency_specialized", choices=("auto", "latency_specialized"))
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    llm = LLM(model=args.model, tensor_parallel_size=args.tp, trust_remote_code=True,
              additional_config={"decode_backend": args.decode_backend})
    prompts = ["Explain attention residuals in two sentences.", "Write a haiku about GPUs."]
    for out in llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0)):
        print(f"--- {out.prompt}\n{out.outputs[0].text}\n")


if __name__ == "__main__":
    main()

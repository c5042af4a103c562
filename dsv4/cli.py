"""``dsv4`` command line: ``generate``, ``serve``, ``bench throughput``, ``bench serve``, ``validate``, ``check``,
``make-tiny``, ``make-synthetic``."""
from __future__ import annotations

import argparse
import sys
import time


def _engine_kw(a: argparse.Namespace) -> dict:
    return dict(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                long_prefill_token_threshold=a.long_prefill_token_threshold,
                max_model_len=a.max_model_len, kv_cache_memory=a.kv_cache_memory,
                gpu_memory_utilization=a.gpu_memory_utilization, device=a.device,
                cuda_graphs=not a.enforce_eager, log=not a.quiet, synthetic=a.synthetic,
                synthetic_layers=a.layers, synthetic_experts=a.experts, synthetic_seed=a.synthetic_seed,
                tensor_parallel_size=a.tensor_parallel_size, revision=a.revision,
                speculative_config=a.speculative_config, enable_prefix_caching=a.enable_prefix_caching,
                kernel_check=a.kernel_check)


def _cmd_generate(a: argparse.Namespace) -> int:
    from .engine.llm import LLM
    from .engine.sampling_params import SamplingParams

    if a.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    t0 = time.perf_counter()
    llm = LLM(a.model, **_engine_kw(a))
    if not a.quiet:
        print(f"dsv4: loaded {llm.engine.model_path} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    t1 = time.perf_counter()
    sp = SamplingParams(temperature=a.temperature, top_p=a.top_p, seed=a.seed, max_tokens=a.max_tokens)
    out = llm.generate([a.prompt], sp)[0].outputs[0]
    if out.error:
        print(f"dsv4: error: {out.error}", file=sys.stderr)
        return 1
    sys.stdout.write(out.text + "\n")
    if not a.quiet:
        dt = time.perf_counter() - t1
        n = len(out.token_ids)
        print(f"dsv4: {n} tokens in {dt:.2f}s ({n / max(dt, 1e-9):.1f} tok/s), finish_reason={out.finish_reason}",
              file=sys.stderr)
    return 0


def _cmd_bench_throughput(a: argparse.Namespace) -> int:
    from .engine.llm import LLM, benchmark_throughput
    if not a.quiet:
        what = f"a synthetic {a.synthetic} model ({a.layers} layers)" if a.synthetic else \
            (a.model or "the embedded tiny model")
        print(f"dsv4 bench throughput: building {what}", file=sys.stderr, flush=True)
    llm = LLM(a.model, **_engine_kw(a))
    if not a.quiet:
        print(f"dsv4 bench throughput: {a.num_prompts} prompts of {a.input_len} tokens, {a.output_len} output "
              f"tokens each", file=sys.stderr, flush=True)
    r = benchmark_throughput(llm, a.num_prompts, a.input_len, a.output_len, a.seed or 0, progress=not a.quiet)
    print(f"requests      {r['requests']}\nelapsed       {r['elapsed_s']:.2f} s\n"
          f"requests/s    {r['requests_per_s']:.2f}\noutput tok/s  {r['output_tokens_per_s']:.1f}\n"
          f"total tok/s   {r['total_tokens_per_s']:.1f}\nsteps         {r['steps']}\n"
          f"mean step     {r['mean_step_ms']:.1f} ms\npreemptions   {r['preemptions']}")
    if a.output_json:
        import json
        with open(a.output_json, "w") as fh:
            json.dump(r, fh, indent=2)
    return 0


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """Engine settings shared by generate, bench throughput and serve."""
    p.add_argument("--max-num-seqs", type=int, default=None, help='most sequences in a batch (default 128 on a GPU, 16 on a CPU)')
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help='token budget of one step; prefill chunks are cut to it (default 8192 on a GPU, 512 on a CPU)')
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="> 0: cut every prefill chunk of one request to this many tokens, so that long prompts "
                        "share a step's budget and keep the running decodes' steps short (default 0: off)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's max_position_embeddings, capped by the KV cache)")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 512MiB (CPU default 256MiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help='share of the GPU memory free after loading that the KV cache takes (default 0.9)')
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for the decode step")
    p.add_argument("--synthetic", choices=["flash", "pro"], default=None,
                   help="serve random weights at the preset's real shapes, generated on the device (no checkpoint)")
    p.add_argument("--layers", type=int, default=4, help="layers of a --synthetic model")
    p.add_argument("--experts", type=int, default=None, help="routed experts of a --synthetic model (default: all)")
    p.add_argument("--synthetic-seed", type=int, default=0, help='seed of the --synthetic weights')
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many ranks, one process each (GPU i for rank i)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face Hub model id (default: main)")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding, vLLM\'s JSON: \'{"method": "mtp", "num_speculative_tokens": 3}\' '
                        '(drafts with the checkpoint\'s MTP block)')
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of prompt prefixes seen before, in 256-token blocks (default on)")
    p.add_argument("--kernel-check", choices=["fast", "full", "off"], default="fast",
                   help="at start-up, check every op's kernel against its twin on this GPU; an op that fails "
                        "falls back to a portable kernel or its twin (default fast; `dsv4 check` prints the table)")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face Hub id (default: the embedded tiny model)")
    _engine_flags(p)
    p.add_argument("--seed", type=int, default=None, help='sampling seed (default: random)')
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or timing on stderr")


def _cmd_make_tiny(a: argparse.Namespace) -> int:
    from .checkpoint.tiny import make_tiny
    path = make_tiny(a.dir, layout=a.layout, seed=a.seed, shards=a.shards, overwrite=a.overwrite, draft=a.draft)
    print(path)
    return 0


def _cmd_make_synthetic(a: argparse.Namespace) -> int:
    from .checkpoint.synthetic import human_size, make_synthetic, synthetic_config
    cfg = synthetic_config(a.preset, a.layers, a.experts, draft=a.draft)
    r = make_synthetic(a.dir, cfg, layout=a.layout, seed=a.seed, device=a.device, max_shard_size=a.max_shard_size,
                       overwrite=a.overwrite, draft=a.draft != "none")
    print(f"wrote {human_size(r.total_bytes)} ({r.shards} shard(s), {r.tensors} tensors) to {r.path}")
    return 0


def _cmd_serve(a: argparse.Namespace) -> int:
    import os

    try:
        import uvicorn

        from .server.app import build_app
    except ImportError as e:
        print(f"dsv4: error: serving needs fastapi, uvicorn and prometheus-client ({e}); "
              f"pip install fastapi uvicorn prometheus-client", file=sys.stderr)
        return 2
    from .engine.llm_engine import EngineConfig, LLMEngine

    if a.max_waiting is not None and a.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {a.max_waiting}")
    if a.max_stored_responses < 0:
        raise ValueError(f"--max-stored-responses must be >= 0, got {a.max_stored_responses}")
    template = None
    if a.chat_template is not None:
        from .server.jinja_template import load_chat_template
        template = load_chat_template(a.chat_template)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=a.model, seed=a.seed, generation_config=a.generation_config,
                                    **_engine_kw(a)))
    api_key = a.api_key or os.environ.get("DSV4_API_KEY") or None
    from .engine.llm_engine import parse_bytes
    app = build_app(engine, served_model_name=a.served_model_name, api_key=api_key, max_waiting=a.max_waiting,
                    log=not a.quiet, max_request_bytes=parse_bytes(a.max_request_bytes),
                    max_stored_responses=a.max_stored_responses, chat_template=template,
                    allowed_origins=a.allowed_origins, log_requests=a.enable_log_requests)
    name = app.state.server.name
    if not a.quiet:
        print(f"dsv4: loaded {engine.model_path} in {time.perf_counter() - t0:.1f}s; serving {name!r} on "
              f"http://{a.host}:{a.port}/v1" + (" (API key required)" if api_key else ""), file=sys.stderr)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.uvicorn_log_level,
                access_log=not a.disable_access_log, timeout_graceful_shutdown=5)
    return 0


def _cmd_bench_serve(a: argparse.Namespace) -> int:
    from .server.bench import main_from_args
    return main_from_args(a)


def _accept(flag: str, accepted: tuple, why: str, kind=str):
    """An argparse type that takes only ``accepted`` values of ``flag`` and otherwise says why."""
    def check(v: str):
        try:
            value = kind(v)
        except ValueError:
            value = None
        if value not in accepted:
            raise argparse.ArgumentTypeError(f"{v!r} is not supported: {why} (accepted: "
                                             f"{', '.join(str(x) for x in accepted)})")
        return value
    check.__name__ = flag
    return check


def _origins(v: str) -> list[str]:
    """``--allowed-origins``: vLLM's JSON list (``'["https://a.example"]'``) or comma-separated origins."""
    import json
    if v.strip().startswith("["):
        try:
            out = json.loads(v)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list of origins: {e}") from None
        if not isinstance(out, list) or not all(isinstance(o, str) for o in out):
            raise argparse.ArgumentTypeError("expected a JSON list of origin strings")
        return out
    return [o.strip() for o in v.split(",") if o.strip()]


def _vllm_args(p: argparse.ArgumentParser) -> None:
    """The flags V4 launch scripts for vLLM carry, with vLLM's meaning (README: Coming from vLLM)."""
    g = p.add_argument_group("vLLM compatibility")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the global RNG that requests without their own seed sample from (default: random)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (file, or the template text) rendered as transformers' "
                        "apply_chat_template does, instead of the built-in V4 encoding")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="default sampling parameters: auto (default) takes the model's generation_config.json, "
                        "vllm ignores it, DIR reads DIR/generation_config.json; request values come first")
    g.add_argument("--tokenizer-mode", default="auto", metavar="auto|deepseek_v4", type=_accept(
        "--tokenizer-mode", ("auto", "deepseek_v4"), "the V4 tokenizer and chat encoding are built in"),
                   help="accepted: the V4 tokenizer and chat encoding are built in")
    g.add_argument("--tool-call-parser", default="deepseek_v4", metavar="deepseek_v4", type=_accept(
        "--tool-call-parser", ("deepseek_v4",), "V4's DSML tool-call parser is built in"),
                   help="accepted: V4's DSML tool-call parser is built in")
    g.add_argument("--reasoning-parser", default="deepseek_v4", metavar="deepseek_v4", type=_accept(
        "--reasoning-parser", ("deepseek_v4",), "V4's reasoning parser is built in"),
                   help="accepted: V4's reasoning parser (<think> ... </think>) is built in")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted; auto tool choice is always on (the V4 tool-call parser is built in)")
    logs = g.add_mutually_exclusive_group()
    logs.add_argument("--enable-log-requests", action="store_true",
                      help="one line per request on stderr (id, prompt tokens, sampling parameters)")
    logs.add_argument("--disable-log-requests", action="store_true", help="no request lines (the default)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted and ignored: dsv4 runs no code from the checkpoint (V4's model and tokenizer "
                        "are built in)")
    g.add_argument("--dtype", default="auto", metavar="auto|bfloat16", type=_accept(
        "--dtype", ("auto", "bfloat16"), "the engine computes in the checkpoint's own formats (FP8 / FP4 weights, "
        "bf16 activations), which auto and bfloat16 both mean"),
                   help="accepted: the engine computes in the checkpoint's own formats (FP8 / FP4 weights, bf16 "
                        "activations)")
    g.add_argument("--kv-cache-dtype", default="auto", metavar="auto|fp8", type=_accept(
        "--kv-cache-dtype", ("auto", "fp8"), "V4's KV cache is FP8 (584-byte entries), which auto and fp8 both mean"),
                   help="accepted: V4's KV cache is FP8")
    g.add_argument("--block-size", default=256, metavar="256", help="accepted: KV blocks are 256 tokens", type=_accept(
        "--block-size", (256,), "V4's paged KV cache is laid out in 256-token blocks (64 ratio-4 and 2 ratio-128 "
        "compressed entries each)", int))
    g.add_argument("--allowed-origins", type=_origins, default=None, metavar="ORIGINS",
                   help='origins browsers may call the API from (CORS): a JSON list as vLLM takes it '
                        '(\'["https://app.example"]\') or comma-separated; default none')


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or Hugging Face Hub id (default: the embedded tiny model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help='port (default 8000)')
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: dsv4-tiny, the checkpoint dir's name, or the Hub id)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /version and "
                        "/metrics (also env DSV4_API_KEY)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="when this many requests wait for the engine, new ones get 503 (default: unbounded)")
    p.add_argument("--max-request-bytes", default="8MiB",
                   help="larger request bodies get 413 before they are read in full (default 8MiB)")
    p.add_argument("--max-stored-responses", type=int, default=1000,
                   help="/v1/responses kept for previous_response_id and GET /v1/responses/{id}, the most recent "
                        "first (default 1000; 0 keeps none)")
    _engine_flags(p)
    _vllm_args(p)
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level (default info)")
    p.add_argument("--disable-access-log", "--disable-uvicorn-access-log", action="store_true",
                   help="no per-request access log lines")
    p.add_argument("-q", "--quiet", action="store_true", help="no engine progress on stderr")


def _draft_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", choices=["none", "mtp", "dspark"], default="mtp",
                   help="the mtp.* draft to write: none, the April preview's MTP block (default), or the "
                        "3-stage DSpark draft of V4-Flash-0731 / V4-Pro-0813 / V4-*-DSpark (with its config keys)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 inference engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="continue a prompt (text on stdout; greedy by default)")
    g.add_argument("prompt", help='the text to continue')
    g.add_argument("--max-tokens", type=int, default=32, help='tokens to generate (default 32)')
    g.add_argument("--temperature", type=float, default=0.0, help='sampling temperature; 0 = greedy (default)')
    g.add_argument("--top-p", type=float, default=1.0, help='nucleus sampling mass (default 1: off)')
    _engine_args(g)
    g.set_defaults(fn=_cmd_generate)
    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bt = b.add_parser("throughput", help="offline throughput on random prompts")
    bt.add_argument("--num-prompts", type=int, default=32, help='random prompts (default 32)')
    bt.add_argument("--input-len", type=int, default=128, help='tokens per prompt (default 128)')
    bt.add_argument("--output-len", type=int, default=32, help='tokens generated per prompt (default 32)')
    bt.add_argument("--output-json", default=None, help='also write the results to this JSON file')
    _engine_args(bt)
    bt.set_defaults(fn=_cmd_bench_throughput)
    bs = b.add_parser("serve", help="online benchmark of a running server (like `vllm bench serve`)")
    from .server.bench import add_cli_args as _bench_serve_args
    _bench_serve_args(bs)
    bs.set_defaults(fn=_cmd_bench_serve)
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _serve_args(sv)
    sv.set_defaults(fn=_cmd_serve)
    from .tools.validate import add_parser as add_validate
    add_validate(sub)
    from .tools.check import add_parser as add_check
    add_check(sub)
    t = sub.add_parser("make-tiny", help="write the deterministic tiny V4 checkpoint")
    t.add_argument("dir", help='output directory (must not exist or be empty, unless --overwrite)')
    t.add_argument("--layout", choices=["official", "hf", "modelopt-nvfp4"], default="official", help='checkpoint layout to write (default official)')
    t.add_argument("--seed", type=int, default=0, help='weight seed (default 0)')
    t.add_argument("--shards", type=int, default=1, help='safetensors files to split the weights into (default 1)')
    _draft_arg(t)
    t.add_argument("--overwrite", action="store_true", help='replace the contents of a non-empty directory')
    t.set_defaults(fn=_cmd_make_tiny)
    s = sub.add_parser("make-synthetic", help="write a random checkpoint with the real Flash / Pro shapes and formats")
    s.add_argument("dir", help='output directory (must not exist or be empty, unless --overwrite)')
    s.add_argument("--model", "--preset", dest="preset", choices=["flash", "pro"], default="flash",
                   help='real shapes of V4-Flash or V4-Pro (default flash)')
    s.add_argument("--layers", type=int, default=4, help="the preset's first N layers (default 4)")
    s.add_argument("--experts", type=int, default=None, help="routed experts (default: all of the preset)")
    s.add_argument("--layout", choices=["official", "hf", "modelopt-nvfp4"], default="official", help='checkpoint layout to write (default official)')
    s.add_argument("--seed", type=int, default=0, help='weight seed (default 0)')
    s.add_argument("--device", default=None, help="where to generate: cpu or cuda (default: cuda if available)")
    s.add_argument("--max-shard-size", default="5GB", help='largest safetensors file (default 5GB)')
    _draft_arg(s)
    s.add_argument("--overwrite", action="store_true", help='replace the contents of a non-empty directory')
    s.set_defaults(fn=_cmd_make_synthetic)
    return p


def _command_parser(p: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command ``a`` names (``dsv4 serve``, ``dsv4 bench serve``, ...)."""
    for key in ("cmd", "bench"):
        subs = [x for x in p._actions if isinstance(x, argparse._SubParsersAction)]
        name = getattr(a, key, None)
        if not subs or name not in subs[0].choices:
            break
        p = subs[0].choices[name]
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a, extra = p.parse_known_args(argv)
    if extra:       # named by the command's own parser, with its usage (argparse would print the top one)
        _command_parser(p, a).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return a.fn(a)
    except (OSError, ValueError) as e:
        print(f"dsv4: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

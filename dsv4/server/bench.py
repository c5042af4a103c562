"""``dsv4 bench serve``: online serving benchmark shaped like ``vllm bench serve`` (spec §1.7).

Sends ``--num-prompts`` random prompts of ``--random-input-len`` tokens asking for
``--random-output-len`` tokens, streamed, to a running OpenAI-compatible server, at
``--request-rate`` (Poisson arrivals, ``inf`` = all at once) and/or under ``--max-concurrency``.
Metrics follow ``calculate_metrics`` in vllm/benchmarks/serve.py:

* TTFT: client time from sending the request to the first streamed token;
* TPOT: per request ``(latency - ttft) / (output_len - 1)``; requests with output_len <= 1 left out;
* ITL: every gap between consecutive streamed chunks, pooled over all requests;
* E2EL: full request latency;
* throughputs over the benchmark's wall time: completed requests/s, output tokens/s,
  (input + output) tokens/s, and peak output tokens/s in 1 s buckets.

Each latency metric is reported as mean / median / std / percentiles (``--metric-percentiles``,
default 50,90,99) in ms. Output lengths come from the server's usage chunk
(``stream_options.include_usage``), else from counting streamed chunks; input lengths from the
same chunk's ``prompt_tokens``, else counted here: the token ids sent, or for chat the message's
tokens after the V4 chat template (what the server prefills, not the random ids it was made of).

Prompts are random token ids below 128000 (no special tokens), seeded by ``--seed``: sent as
token-id lists to ``/v1/completions``, or decoded to text for ``/v1/chat/completions``. The saved
JSON names the model served (``model_id``: ``--model``, else the first of ``GET /v1/models``).

Datasets (``--dataset-name``):

* ``random``: ``--num-prompts`` prompts of ``--random-input-len`` tokens;
* ``prefix_repetition`` (vLLM's): ``--prefix-repetition-num-prefixes`` random prefixes of
  ``--prefix-repetition-prefix-len`` tokens, each followed by unique random suffixes of
  ``--prefix-repetition-suffix-len`` tokens in ``num-prompts / num-prefixes`` prompts, shuffled,
  asking for ``--prefix-repetition-output-len`` tokens;
* ``multi_turn``: ``--num-prompts`` conversations of ``--multi-turn-turns`` turns replayed in
  order: turn 1 sends a user message of ``--random-input-len`` tokens, each later turn the whole
  conversation so far (the previous prompt, the reply the server streamed, a new user message of
  ``--multi-turn-user-len`` tokens); ``--request-rate`` paces the conversations' starts and
  ``--max-concurrency`` bounds the requests in flight. The report adds the mean TTFT of each turn.

The server's ``usage.prompt_tokens_details.cached_tokens`` (its prefix cache) is summed into
``total_cached_tokens``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

SPECIAL_START = 128000      # V4: ids from here on are special / added tokens


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0                 # perf_counter at send
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""
    cached_tokens: int = 0             # usage.prompt_tokens_details.cached_tokens
    turn: int = 0                      # multi_turn: the turn's index in its conversation


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server base URL, e.g. http://127.0.0.1:8000 "
                                                    "(default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help='server host (default 127.0.0.1)')
    p.add_argument("--port", type=int, default=8000, help='server port (default 8000)')
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer key (default: env DSV4_API_KEY or OPENAI_API_KEY)")
    p.add_argument("--dataset-name", default="random", choices=["random", "prefix_repetition", "multi_turn"],
                   help="random prompts (default), prompts sharing prefixes, or multi-turn conversations")
    p.add_argument("--num-prompts", type=int, default=32, help='requests to send (default 32)')
    p.add_argument("--random-input-len", type=int, default=64, help='prompt tokens per request (default 64)')
    p.add_argument("--random-output-len", type=int, default=16, help='tokens asked for per request (default 16)')
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="prefix_repetition: prefix tokens "
                   "(default 256)")
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="prefix_repetition: unique suffix "
                   "tokens per prompt (default 256)")
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="prefix_repetition: prefixes; "
                   "each starts num-prompts / num-prefixes prompts (default 10)")
    p.add_argument("--prefix-repetition-output-len", type=int, default=128, help="prefix_repetition: tokens asked "
                   "for per request (default 128)")
    p.add_argument("--multi-turn-turns", type=int, default=4, help="multi_turn: turns per conversation (default 4)")
    p.add_argument("--multi-turn-user-len", type=int, default=64, help="multi_turn: tokens of each user message after "
                   "the first (default 64)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf (default) sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--temperature", type=float, default=0.0, help='sampling temperature (default 0: greedy)')
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (exact output lengths)")
    p.add_argument("--seed", type=int, default=0, help='seed of the random prompts and arrivals (default 0)')
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help='metrics to report percentiles of')
    p.add_argument("--metric-percentiles", default="50,90,99", help='percentiles to report (default 50,90,99)')
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument("--result-file", default=None, help="JSON file name (default: a timestamped name)")
    p.add_argument("--result-dir", default=None, help='directory of the --save-result file (default: here)')
    p.add_argument("--save-detailed", action="store_true", help="also save per-request lists (ttfts, itls, ...)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write latency histograms to this PNG (matplotlib)")
    p.add_argument("--disable-tqdm", action="store_true", help='no progress bar')
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")


def _lens(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_prompts(num: int, input_len: int, output_len: int, ratio: float, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    ins, outs = _lens(input_len, ratio, num, rng), _lens(output_len, ratio, num, rng)
    return [([rng.randrange(100, SPECIAL_START) for _ in range(i)], o) for i, o in zip(ins, outs)]


def _check_prefix_repetition(num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int) -> None:
    if min(prefix_len, output_len) < 1 or suffix_len < 0:
        raise ValueError("--prefix-repetition-prefix-len and --prefix-repetition-output-len must be >= 1, "
                         "--prefix-repetition-suffix-len >= 0")
    if num_prefixes < 1 or num % num_prefixes:
        raise ValueError(f"--num-prompts ({num}) must be a positive multiple of --prefix-repetition-num-prefixes "
                         f"({num_prefixes})")


def make_prefix_repetition(num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                           seed: int) -> list[tuple[list[int], int]]:
    """vLLM's prefix_repetition dataset: ``num_prefixes`` random prefixes, each followed by unique
    random suffixes in ``num // num_prefixes`` prompts, shuffled."""
    _check_prefix_repetition(num, prefix_len, suffix_len, num_prefixes, output_len)
    rng = random.Random(seed)
    out = []
    for _ in range(num_prefixes):
        prefix = [rng.randrange(100, SPECIAL_START) for _ in range(prefix_len)]
        for _ in range(num // num_prefixes):
            out.append((prefix + [rng.randrange(100, SPECIAL_START) for _ in range(suffix_len)], output_len))
    rng.shuffle(out)
    return out


async def _arrivals(n: int, rate: float, burstiness: float, rng: random.Random):
    for i in range(n):
        yield i
        if rate == float("inf") or i == n - 1:
            continue
        theta = 1.0 / (rate * burstiness)
        await asyncio.sleep(rng.gammavariate(burstiness, theta))


def chat_messages(ids: list[int], tok, history: list[dict] | None = None) -> tuple[list[dict], int]:
    """The chat request's messages for the random prompt ``ids`` (decoded to text) after
    ``history`` (earlier turns), and their token count after the V4 chat template."""
    from .chat_encoding import apply_chat_template
    msgs = list(history or []) + [{"role": "user", "content": tok.decode(ids)}]
    return msgs, len(apply_chat_template(tok, msgs))


async def _one(client, url: str, headers: dict, payload: dict, chat: bool, prompt_len: int,
               timeout: float) -> RequestResult:
    """One streamed request; ``prompt_len`` is the client's count, replaced by the server's
    ``usage.prompt_tokens`` when it sends one."""
    r = RequestResult(prompt_len=prompt_len)
    st = r.start = time.perf_counter()
    last = st
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers, timeout=timeout) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {body[:300]}"
                return r
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    r.error = json.dumps(obj["error"])[:300]
                    return r
                if obj.get("usage") and not obj.get("choices"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                    if isinstance(obj["usage"].get("prompt_tokens"), int):
                        r.prompt_len = obj["usage"]["prompt_tokens"]
                    r.cached_tokens = int((obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                    continue
                text = ""
                for ch in obj.get("choices", []):
                    if chat:
                        d = ch.get("delta") or {}
                        text += (d.get("content") or "") + (d.get("reasoning_content") or "")
                    else:
                        text += ch.get("text") or ""
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    r.ttft = now - st
                else:
                    r.itl.append(now - last)
                r.chunk_times.append(now)
                last = now
                chunks += 1
                r.generated_text += text
        r.latency = time.perf_counter() - st
        r.output_len = usage_tokens if usage_tokens is not None else chunks
        r.success = chunks > 0 or r.output_len > 0
        if not r.success:
            r.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        r.error = f"{type(e).__name__}: {e}"
    return r


def _stats(xs: list[float], percentiles: list[float]) -> dict:
    import numpy as np
    a = np.asarray(xs, dtype=float) * 1000.0 if xs else np.zeros(1)
    d = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p in percentiles:
        d[f"p{_pword(p)}"] = float(np.percentile(a, p))
    return d


def _pword(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def calculate_metrics(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    out = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    # peak output tokens/s over 1 s buckets (one token per chunk, scaled to the usage count)
    if ok:
        t0 = min(r.start for r in ok)
        buckets: dict[int, float] = {}
        for r in ok:
            per = r.output_len / max(len(r.chunk_times), 1)
            for t in r.chunk_times:
                k = int(t - t0)
                buckets[k] = buckets.get(k, 0.0) + per
        out["max_output_tokens_per_s"] = max(buckets.values()) if buckets else 0.0
        events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])
        cur = peak = 0
        for _, d in events:
            cur += d
            peak = max(peak, cur)
        out["max_concurrent_requests"] = peak
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for k, v in _stats(xs, percentiles).items():
            out[f"{k}_{name}_ms"] = v
    turns = sorted({r.turn for r in ok})
    if turns != [0]:
        out["mean_ttft_ms_by_turn"] = [_stats([r.ttft for r in ok if r.turn == t], [])["mean"] for t in turns]
    return out


def print_report(m: dict, args, metrics: list[str], percentiles: list[float]) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    rows = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"]),
            ("Request rate configured (RPS):", rate),
            ("Maximum request concurrency:", args.max_concurrency if args.max_concurrency else "none"),
            ("Benchmark duration (s):", f"{m['duration']:.2f}"),
            ("Total input tokens:", m["total_input_tokens"]), ("Total generated tokens:", m["total_output_tokens"]),
            ("Total cached input tokens:", m.get("total_cached_tokens", 0)),
            ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
            ("Peak output token throughput (tok/s):", f"{m.get('max_output_tokens_per_s', 0.0):.2f}"),
            ("Peak concurrent requests:", m.get("max_concurrent_requests", 0)),
            ("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v:<10}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in metrics:
        print("{s:{c}^{n}}".format(s=titles[name], n=w, c="-"))
        upper = name.upper()
        print(f"{'Mean ' + upper + ' (ms):':<40}{m[f'mean_{name}_ms']:<10.2f}")
        print(f"{'Median ' + upper + ' (ms):':<40}{m[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            print(f"{'P' + _pword(p) + ' ' + upper + ' (ms):':<40}{m[f'p{_pword(p)}_{name}_ms']:<10.2f}")
        if name == "ttft":
            for t, v in enumerate(m.get("mean_ttft_ms_by_turn", [])):
                print(f"{f'Mean TTFT turn {t + 1} (ms):':<40}{v:<10.2f}")
    if "spec_decode_num_drafts" in m:
        print("{s:{c}^{n}}".format(s="Speculative Decoding", n=w, c="-"))
        for k, v in (("Acceptance rate (%):", f"{100 * m['spec_decode_acceptance_rate']:.2f}"),
                     ("Acceptance length:", f"{m['spec_decode_acceptance_length']:.2f}"),
                     ("Drafts:", m["spec_decode_num_drafts"]), ("Draft tokens:", m["spec_decode_draft_tokens"]),
                     ("Accepted tokens:", m["spec_decode_accepted_tokens"])):
            print(f"{k:<40}{v:<10}")
        print("Per-position acceptance (%):".ljust(40) +
              ", ".join(f"{100 * r:.2f}" for r in m["spec_decode_per_position_acceptance_rate"]))
    print("=" * w)


def plot(results: list[RequestResult], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("dsv4 bench serve: matplotlib is not installed; skipping --plot", file=sys.stderr)
        return False
    ok = [r for r in results if r.success]
    series = [("TTFT", [r.ttft * 1e3 for r in ok]),
              ("TPOT", [(r.latency - r.ttft) / (r.output_len - 1) * 1e3 for r in ok if r.output_len > 1]),
              ("ITL", [x * 1e3 for r in ok for x in r.itl]),
              ("E2EL", [r.latency * 1e3 for r in ok])]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, xs) in zip(axes.flat, series):
        if xs:
            ax.hist(xs, bins=min(50, max(5, int(math.sqrt(len(xs))) * 2)), color="tab:blue", alpha=0.8)
        ax.set_title(f"{name} (n={len(xs)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    fig.suptitle("dsv4 bench serve: latency histograms")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


async def run_benchmark(args) -> tuple[dict, list[RequestResult]]:
    import httpx

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    chat = "chat" in args.endpoint
    multi = args.dataset_name == "multi_turn"
    url = base + args.endpoint
    key = args.api_key or os.environ.get("DSV4_API_KEY") or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=args.timeout) as client:
        model = args.model
        if model is None:
            r = await client.get(base + "/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        if args.dataset_name == "prefix_repetition":
            prompts = make_prefix_repetition(args.num_prompts, args.prefix_repetition_prefix_len,
                                             args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                             args.prefix_repetition_output_len, args.seed)
        else:
            prompts = make_prompts(args.num_prompts, args.random_input_len, args.random_output_len,
                                   args.random_range_ratio, args.seed)
        tok = None
        if chat or multi:
            from ..tokenizer import load_tokenizer
            tok = load_tokenizer(None)

        def request(ids: list[int], out_len: int, history: list[dict] | None = None) -> tuple[dict, int]:
            """The request body and its prompt's token count (chat: after the chat template);
            ``history``: the conversation before the user message ``ids`` (chat)."""
            d = {"model": model, "max_tokens": out_len, "temperature": args.temperature, "stream": True,
                 "stream_options": {"include_usage": True}}
            if args.ignore_eos:
                d["ignore_eos"] = True
            if chat:
                d["messages"], n = chat_messages(ids, tok, history)
            else:
                d["prompt"], n = ids, len(ids)
            return d, n

        reqs = [request(ids, out_len) for ids, out_len in prompts]
        # one test request first (as vLLM does): fail fast when the server is not usable
        test = await _one(client, url, headers, {**reqs[0][0], "max_tokens": min(prompts[0][1], 4)}, chat,
                          reqs[0][1], args.timeout)
        if not test.success:
            raise RuntimeError(f"the test request failed: {test.error}")
        print(f"dsv4 bench serve: {args.num_prompts} {'conversations' if multi else 'prompts'} -> {url} "
              f"(model {model}); test request ok", file=sys.stderr)

        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed)

        async def limited(body, prompt_len):
            if sem is None:
                return await _one(client, url, headers, body, chat, prompt_len, args.timeout)
            async with sem:
                return await _one(client, url, headers, body, chat, prompt_len, args.timeout)

        spec0 = await _spec_counters(client, base, headers)
        async def conversation(i: int) -> list[RequestResult]:
            """Conversation ``i``'s turns in order, each resending everything before it."""
            crng = random.Random(args.seed * 1_000_003 + i)
            ids, out_len = prompts[i]
            history: list[dict] = []
            out = []
            for t in range(args.multi_turn_turns):
                r = await limited(*request(ids, out_len, history))
                r.turn = t
                out.append(r)
                if not r.success:
                    break
                new = [crng.randrange(100, SPECIAL_START) for _ in range(args.multi_turn_user_len)]
                if chat:
                    history += [{"role": "user", "content": tok.decode(ids)},
                                {"role": "assistant", "content": r.generated_text}]
                    ids = new
                else:
                    ids = ids + tok.encode(r.generated_text) + new
            return out

        t0 = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(reqs), args.request_rate, args.burstiness, rng):
            tasks.append(asyncio.create_task(conversation(i) if multi else limited(*reqs[i])))
        done = await asyncio.gather(*tasks)
        results = [r for x in done for r in x] if multi else list(done)
        duration = time.perf_counter() - t0
        spec1 = await _spec_counters(client, base, headers)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    m = {"model_id": model, **calculate_metrics(results, duration, percentiles)}
    m.update(spec_decode_metrics(spec0, spec1))
    return m, results


_SPEC = "vllm:spec_decode_num_"


async def _spec_counters(client, base: str, headers: dict) -> dict:
    """The server's speculative-decoding counters from ``/metrics`` ({} when it has none)."""
    try:
        r = await client.get(base + "/metrics", headers=headers)
    except Exception:  # noqa: BLE001 - a server without metrics just has no acceptance figures
        return {}
    if r.status_code != 200:
        return {}
    return parse_spec_counters(r.text)


def parse_spec_counters(text: str) -> dict:
    """{'drafts' | 'draft_tokens' | 'accepted_tokens': total, ('per_pos', i): total} from a
    Prometheus text exposition (vLLM's counter names, '_total' samples)."""
    out: dict = {}
    for line in text.splitlines():
        if not line.startswith(_SPEC) or "_total" not in line.split("{")[0].split(" ")[0]:
            continue
        name, value = line.rsplit(" ", 1)
        key = name[len(_SPEC):].split("{")[0].removesuffix("_total")
        if key == "accepted_tokens_per_pos":
            pos = int(name.split('position="')[1].split('"')[0])
            out[("per_pos", pos)] = out.get(("per_pos", pos), 0) + float(value)
        elif key in ("drafts", "draft_tokens", "accepted_tokens"):
            out[key] = out.get(key, 0) + float(value)
    return out


def spec_decode_metrics(before: dict, after: dict) -> dict:
    """vLLM's speculative-decoding figures over the run: acceptance rate (accepted / drafted
    tokens), mean acceptance length (1 + accepted / drafts: tokens emitted per verify step) and
    the acceptance rate by draft position; {} when no draft was verified."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    drafts = d.get("drafts", 0)
    if drafts <= 0:
        return {}
    pos = sorted(k[1] for k in d if isinstance(k, tuple))
    return {"spec_decode_num_drafts": int(drafts), "spec_decode_draft_tokens": int(d.get("draft_tokens", 0)),
            "spec_decode_accepted_tokens": int(d.get("accepted_tokens", 0)),
            "spec_decode_acceptance_rate": d.get("accepted_tokens", 0) / max(1, d.get("draft_tokens", 0)),
            "spec_decode_acceptance_length": 1 + d.get("accepted_tokens", 0) / drafts,
            "spec_decode_per_position_acceptance_rate": [d.get(("per_pos", p), 0) / drafts for p in pos]}


def main_from_args(args) -> int:
    metrics = [x.strip() for x in args.percentile_metrics.split(",") if x.strip()]
    bad = [x for x in metrics if x not in ("ttft", "tpot", "itl", "e2el")]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {bad} (choose from ttft,tpot,itl,e2el)")
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if args.dataset_name == "prefix_repetition":
        _check_prefix_repetition(args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                 args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len)
    if args.dataset_name == "multi_turn" and (args.multi_turn_turns < 1 or args.multi_turn_user_len < 1):
        raise ValueError("--multi-turn-turns and --multi-turn-user-len must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf = all at once)")
    try:
        m, results = asyncio.run(run_benchmark(args))
    except Exception as e:  # noqa: BLE001
        print(f"dsv4 bench serve: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    print_report(m, args, metrics, percentiles)
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"dsv4 bench serve: {len(errors)} failed requests, first error: {errors[0]}", file=sys.stderr)
    if args.plot:
        if plot(results, args.plot):
            print(f"dsv4 bench serve: wrote {args.plot}", file=sys.stderr)
    if args.save_result or args.result_file:
        result = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if "chat" in args.endpoint
                  else "openai", "endpoint": args.endpoint, "num_prompts": args.num_prompts,
                  "dataset_name": args.dataset_name,
                  "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
                  "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
                  "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed, **m}
        if args.save_detailed:
            ok = [r for r in results if r.success]
            result.update({"input_lens": [r.prompt_len for r in ok], "output_lens": [r.output_len for r in ok],
                           "ttfts": [r.ttft for r in ok], "itls": [r.itl for r in ok],
                           "errors": [r.error for r in results]})
        name = args.result_file or f"dsv4-bench-serve-{result['date']}.json"
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
            name = os.path.join(args.result_dir, name)
        with open(name, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"dsv4 bench serve: wrote {name}", file=sys.stderr)
    return 0 if not errors else 1


__all__ = ["add_cli_args", "main_from_args", "run_benchmark", "calculate_metrics", "RequestResult"]

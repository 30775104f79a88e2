"""Report of bench/peers: reads the JSON lines every side printed (results.jsonl), prints the
tables (median of the runs, min–max, ratio peer time / Turnstile time, the floor), the targets
(met / missed, with figures), the correctness probe (what each system did), and writes
results.json, report.md and an SVG chart of the ratios. Plain python3, no packages.

Usage: report.py --results DIR/results.jsonl --meta inputs/meta.json --env DIR/env.json
                 --out DIR [--svg PATH]
"""

import argparse
import json
import math
import statistics

# Which system is Turnstile in each workload family, and the peers' display names.
NAMES = {
    "turnstile": "Turnstile (in-process)",
    "floor": "floor: serde_json parse + SHA-256",
    "turnstile_part_validate": "… of which parse + validate + MessageSequence",
    "turnstile_part_render": "… of which render + token count + admission + manifest",
    "litellm": "LiteLLM",
    "litellm_raw_request": "LiteLLM return_raw_request (whole pipeline)",
    "vercel_provider": "Vercel AI SDK provider conversion (getArgs)",
    "vercel_generateText": "Vercel AI SDK generateText (whole pipeline)",
    "vercel": "Vercel AI SDK doStream",
    "vercel_step": "Vercel AI SDK agent step (standardizePrompt + convertToLanguageModelPrompt + getArgs)",
    "litellm_step": "LiteLLM agent step (transform of the whole history)",
    "turnstile_serve": "Turnstile serve (SQLite, synchronous=FULL)",
    "turnstile_serve_tmpfs": "Turnstile serve (SQLite on tmpfs: fsync ≈ free)",
    "litellm_proxy": "LiteLLM proxy (1 worker, default)",
    "litellm_proxy_2w": "LiteLLM proxy (2 workers)",
    "tensorzero_embedded": "TensorZero embedded gateway",
    "direct": "floor: client → simulator directly (non-streamed reply)",
    "direct_stream": "floor: client → simulator directly, streamed reply, kept-alive connections",
    "relay": "ceiling: a relay on Turnstile's HTTP stack that only forwards (no parse, store, render)",
    "turnstile_serve_extra_sim": "Turnstile serve (SQLite FULL) against the TCP_NODELAY simulator build",
    "direct_stream_extra_sim": "floor: streamed reply from the TCP_NODELAY simulator build, kept-alive",
}
PEERS_PREPARE = ["vercel_provider", "vercel_generateText", "litellm", "litellm_raw_request"]
PEERS_STEP = ["vercel_step", "litellm_step"]
PEERS_STREAM = ["vercel", "litellm"]
PEERS_GATEWAY = ["litellm_proxy", "litellm_proxy_2w", "tensorzero_embedded"]
# (workload, peer, minimum ratio, wording)
TARGETS = [
    ("prepare/200", "vercel_provider", 10, "prepare path ≥ 10× faster than the Vercel provider conversion (200 blocks)"),
    ("prepare/200", "litellm", 100, "prepare path ≥ 100× faster than LiteLLM's transform (200 blocks)"),
    # Issue 21: cold prepare beside the peers' conversion, and the agent step.
    ("prepare/20", "vercel_provider", 0.5, "cold prepare ≥ 0.5× the Vercel provider conversion (20 blocks)"),
    ("prepare/200", "vercel_provider", 0.5, "cold prepare ≥ 0.5× the Vercel provider conversion (200 blocks)"),
    ("prepare/2000", "vercel_provider", 0.5, "cold prepare ≥ 0.5× the Vercel provider conversion (2,000 blocks)"),
    ("prepare/20", "litellm", 10, "cold prepare ≥ 10× faster than LiteLLM's transform (20 blocks)"),
    ("prepare/200", "litellm", 10, "cold prepare ≥ 10× faster than LiteLLM's transform (200 blocks)"),
    ("prepare/2000", "litellm", 10, "cold prepare ≥ 10× faster than LiteLLM's transform (2,000 blocks)"),
    ("step/200", "vercel_step", 10, "agent step ≥ 10× faster than the Vercel AI SDK's (200 blocks)"),
    ("step/2000", "vercel_step", 20, "agent step ≥ 20× faster than the Vercel AI SDK's (2,000 blocks)"),
    ("gateway", ("litellm_proxy", "litellm_proxy_2w"), 20,
     "gateway throughput ≥ 20× the LiteLLM proxy (its faster configuration)"),
    ("gateway", "tensorzero_embedded", 1, "gateway throughput above TensorZero's embedded round trip"),
]
STREAM_TARGET = 30
CASES = ["missing_result", "orphan_result", "duplicate_result", "unknown_part", "mid_system",
         "cut_stream/anthropic", "cut_stream/openai-chat"]
PROBE_SYSTEMS = ["turnstile", "litellm", "litellm_modify_params", "vercel", "tensorzero"]
PROBE_NAMES = {"turnstile": "Turnstile", "litellm": "LiteLLM (default)",
               "litellm_modify_params": "LiteLLM (`modify_params=True`)", "vercel": "Vercel AI SDK",
               "tensorzero": "TensorZero (embedded)"}
MID_SYSTEM_TEXT = "Reminder: answer in French."


def fmt_time(seconds):
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def fmt_ratio(ratio):
    if ratio >= 100:
        return f"{ratio:,.0f}×"
    if ratio >= 10:
        return f"{ratio:.1f}×"
    return f"{ratio:.2f}×"


def load(path):
    measurements, unavailable, probes = {}, {}, {}
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if "probe" in record:
            probes[(record["system"], record["probe"])] = record["observation"]
        elif "unavailable" in record:
            unavailable[(record["workload"], record["system"])] = record["unavailable"]
        else:
            key = (record["workload"], record["system"])
            earlier = measurements.get(key)
            if earlier is not None:
                # The same system measured again (the gateway's interleaved rounds): its runs
                # are pooled, per-run lists appended and error counts added.
                record["samples"] = earlier["samples"] + record["samples"]
                extra, before = record.setdefault("extra", {}), earlier.get("extra", {})
                for field, value in before.items():
                    if isinstance(value, list) and isinstance(extra.get(field), list):
                        extra[field] = value + extra[field]
                    elif field == "errors" and isinstance(extra.get(field), int):
                        extra[field] = value + extra[field]
            samples = record["samples"]
            record["median"] = statistics.median(samples)
            record["min"] = min(samples)
            record["max"] = max(samples)
            measurements[key] = record
    return measurements, unavailable, probes


FAMILIES = ("prepare", "step", "stream", "gateway")


def workloads(measurements):
    # The issue-21 additions (rate/, http_step/, fsync) have their own section in `main`.
    names = sorted({w for w, _ in measurements if w.split("/")[0] in FAMILIES}, key=lambda w: (
        {"prepare": 0, "step": 1, "stream": 2, "gateway": 3}[w.split("/")[0]],
        w.split("/")[1] if "/" in w else "",
        int(w.split("/")[-1].replace("k", "000")) if w.split("/")[-1].replace("k", "").isdigit() else 0))
    return names


def table(workload, measurements, unavailable, meta):
    family = workload.split("/")[0]
    base_name = "turnstile_serve" if family == "gateway" else "turnstile"
    base = measurements.get((workload, base_name))
    if family == "prepare":
        order = ["turnstile", "turnstile_part_validate", "turnstile_part_render", "floor"] + PEERS_PREPARE
    elif family == "step":
        order = ["turnstile"] + PEERS_STEP
    elif family == "stream":
        order = ["turnstile", "floor"] + PEERS_STREAM
    else:
        order = ["turnstile_serve", "turnstile_serve_tmpfs", "direct", "direct_stream", "relay",
                 "turnstile_serve_extra_sim", "direct_stream_extra_sim"] + PEERS_GATEWAY
    rows = []
    for system in order:
        record = measurements.get((workload, system))
        if record is None:
            reason = unavailable.get((workload, system))
            if reason is not None:
                rows.append({"system": system, "unavailable": reason})
            continue
        row = {"system": system, "median": record["median"], "min": record["min"], "max": record["max"],
               "runs": len(record["samples"]), "iterations_per_run": record["iterations_per_run"],
               "extra": record.get("extra", {})}
        # Pooled rounds (the gateway's): a round that failed leaves fewer runs behind, said so.
        failed = unavailable.get((workload, system))
        if failed:
            row["failed"] = failed
        if base and system != base_name:
            row["ratio"] = record["median"] / base["median"]
        rows.append(row)
    return rows


def markdown_table(workload, rows, meta):
    family = workload.split("/")[0]
    out = []
    if family == "gateway":
        out.append("| system | per request (median) | min–max | req/s (median) | p50 / p99 latency | "
                   "ratio: peer time / Turnstile time |")
        out.append("| --- | --- | --- | --- | --- | --- |")
    else:
        out.append("| system | median | min–max | runs × reps | ratio: peer time / Turnstile time |")
        out.append("| --- | --- | --- | --- | --- |")
    for row in rows:
        name = NAMES.get(row["system"], row["system"])
        if "unavailable" in row:
            cells = ["not measured: " + row["unavailable"][:120]] + [""] * (4 if family == "gateway" else 3)
            out.append(f"| {name} | " + " | ".join(cells) + " |")
            continue
        ratio = row.get("ratio")
        if row["system"] == "turnstile_serve_extra_sim":
            ratio_text = f"(this build is {1 / ratio:.1f}× the reference's throughput)" if ratio else ""
        elif row["system"].startswith("turnstile_part"):
            ratio_text = f"({ratio * 100:.0f}% of Turnstile's time)" if ratio else ""
        elif row["system"] == "relay":
            ratio_text = f"(Turnstile / ceiling: {fmt_ratio(1 / ratio)})" if ratio else ""
        elif row["system"] in ("floor", "direct") or row["system"].startswith("direct_stream"):
            ratio_text = f"(Turnstile / floor: {fmt_ratio(1 / ratio)})" if ratio else ""
        elif ratio is not None:
            ratio_text = f"**{fmt_ratio(ratio)}**"
        else:
            ratio_text = "1 (reference)"
        if family == "gateway":
            extra = row["extra"]
            p50 = statistics.median(extra.get("p50_s", [0]))
            p99 = statistics.median(extra.get("p99_s", [0]))
            runs = f" ({row['runs']} runs" + (f"; a round failed: {row['failed'][:80]}" if "failed" in row else "") + ")"
            out.append(f"| {name} | {fmt_time(row['median'])} | {fmt_time(row['min'])}–{fmt_time(row['max'])}{runs} | "
                       f"{1 / row['median']:,.0f} | {p50 * 1e3:.1f} / {p99 * 1e3:.1f} ms | {ratio_text} |")
        else:
            out.append(f"| {name} | {fmt_time(row['median'])} | {fmt_time(row['min'])}–{fmt_time(row['max'])} | "
                       f"{row['runs']} × {row['iterations_per_run']} | {ratio_text} |")
    return "\n".join(out)


def title(workload, meta):
    parts = workload.split("/")
    if parts[0] == "prepare":
        info = meta["conversations"][parts[1]]
        return f"Prepare path, {int(parts[1]):,}-block conversation ({info['messages']} messages, parallel tool calls) → Anthropic Messages body"
    if parts[0] == "step":
        info = meta["conversations"][parts[1]]
        return (f"Agent step: one user turn appended to a stored {int(parts[1]):,}-block conversation "
                f"({info['messages']} messages), next Anthropic Messages body prepared")
    if parts[0] == "stream":
        info = meta["streams"][f"{parts[1]}/{parts[2]}"]
        return (f"Stream decode + assemble, {parts[1]} wire format, {info['events']:,} SSE events, "
                f"{info['bytes'] / 1e6:.2f} MB, {info['calls']} parallel tool calls")
    return "Gateway round trip against `turnstile sim` (non-streaming client, 16 concurrent)"


# ----------------------------------------------------------------------------------------------
# Probe classification: rejected / repaired / sent / committed partial
# ----------------------------------------------------------------------------------------------

def results_in(body, fmt):
    found = []
    if fmt == "anthropic":
        for message in body.get("messages", []):
            content = message.get("content")
            if isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") == "tool_result":
                        found.append((part.get("tool_use_id"), json.dumps(part.get("content"))))
    else:
        for message in body.get("messages", []):
            if message.get("role") == "tool":
                found.append((message.get("tool_call_id"), json.dumps(message.get("content"))))
    return found


def where_is_mid_system(body, fmt):
    if fmt == "anthropic":
        if MID_SYSTEM_TEXT in json.dumps(body.get("system", "")):
            return "repaired", "hoisted into the top-level `system`"
        for message in body.get("messages", []):
            if MID_SYSTEM_TEXT in json.dumps(message.get("content")):
                if message.get("role") == "user":
                    return "repaired", "rewritten as *user* text (role changed)"
                return "sent", f"sent as a `{message.get('role')}` message inside `messages` (Anthropic would 400)"
        return "repaired", "dropped"
    for index, message in enumerate(body.get("messages", [])):
        if MID_SYSTEM_TEXT in json.dumps(message.get("content")):
            return "sent", f"sent as a mid-conversation `{message.get('role')}` message"
    return "repaired", "dropped"


def classify(system, case, obs):
    if obs is None:
        return "—", "not probed"
    outcome = obs.get("outcome")
    if system == "turnstile":
        if case.startswith("cut_stream"):
            answer = obs.get("answer", {})
            if obs.get("exit") == 6:
                return "rejected", f"nothing committed (`{answer.get('code')}`, exit 6)"
            return "committed", f"exit {obs.get('exit')}"
        if obs.get("status") == "rejected" and obs.get("render_exit") != 0:
            return "rejected", f"`{', '.join(obs['codes'])}` (validate exit {obs['validate_exit']}, render exit {obs['render_exit']}, no bytes)"
        return "sent", json.dumps(obs)[:120]
    if outcome == "exception":
        error = obs.get("error") or ""
        detail = f"`{error.split(':')[0]}`" + (f": {':'.join(error.split(':')[1:]).strip()[:90]}" if ":" in error else "")
        streamed = [c for c in obs.get("tool_calls", []) if c.get("id") == "c2"]
        if streamed:
            detail += f" — after streaming c2's partial argument deltas `{streamed[0].get('raw_arguments')}` to the caller"
        return "rejected", detail
    if case.startswith("cut_stream"):
        calls = obs.get("tool_calls", [])
        partial = [c for c in calls if c.get("id") == "c2"]
        finish = obs.get("finish_reason")
        if isinstance(finish, dict):
            finish = finish.get("unified")
        if partial:
            args = partial[0].get("arguments", partial[0].get("input", partial[0].get("raw_arguments")))
            return "committed partial", f"call c2 returned with arguments `{args}`, finish `{finish}`" + (
                f", errors {obs['errors']}" if obs.get("errors") else ", no error")
        whole = ", ".join(c.get("id") for c in calls)
        return "repaired", f"unfinished call dropped silently (complete calls: {whole or 'none'}), finish `{finish}`, no error"
    if outcome != "body":
        return "?", json.dumps(obs)[:120]
    fmt = obs.get("format")
    body = obs.get("body") or {}
    results = results_in(body, fmt)
    ids = [r[0] for r in results]
    if case == "missing_result":
        if "c2" in ids:
            text = dict(results)["c2"]
            return "repaired", f"a result for c2 was made up: {text[:80]}"
        return "sent", "sent without a result for c2 (the provider would 400)"
    if case == "orphan_result":
        return ("sent", "orphan c9 result forwarded") if "c9" in ids else ("repaired", "orphan c9 result dropped silently")
    if case == "duplicate_result":
        count = ids.count("c1")
        if count >= 2:
            return "sent", "both c1 results forwarded"
        kept = dict(results).get("c1", "")
        return "repaired", f"one c1 result kept silently: {kept[:40]}"
    if case == "unknown_part":
        if "hologram" in json.dumps(body):
            return "sent", "unknown part forwarded"
        return "repaired", "unknown part dropped silently"
    if case == "mid_system":
        verdict, detail = where_is_mid_system(body, fmt)
        if obs.get("warnings"):
            detail += " (a console warning was printed)"
        return verdict, detail
    return "?", ""


# ----------------------------------------------------------------------------------------------
# SVG
# ----------------------------------------------------------------------------------------------

def svg_chart(bars, subtitle):
    """bars: list of (label, ratio or None, target or None)."""
    left, width, row, top = 430, 430, 22, 58
    lo, hi = 0.1, 10000.0
    height = top + row * len(bars) + 46

    def x(value):
        value = min(max(value, lo), hi)
        return left + width * (math.log10(value) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 30}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="10" y="20" font-size="15" font-weight="bold">Peer time / Turnstile time, same inputs, same run '
           f'(log scale; &gt; 1 = Turnstile faster)</text>',
           f'<text x="10" y="38" fill="#555">{subtitle}</text>']
    for tick in (0.1, 1, 10, 100, 1000, 10000):
        tx = x(tick)
        out.append(f'<line x1="{tx:.1f}" y1="{top - 6}" x2="{tx:.1f}" y2="{top + row * len(bars)}" '
                   f'stroke="{"#333" if tick == 1 else "#ddd"}" stroke-width="{1.5 if tick == 1 else 1}"/>')
        out.append(f'<text x="{tx:.1f}" y="{top + row * len(bars) + 16}" text-anchor="middle" fill="#333">{tick:g}×</text>')
    for index, (label, ratio, target) in enumerate(bars):
        y = top + index * row
        out.append(f'<text x="{left - 8}" y="{y + 14}" text-anchor="end">{escape(label)}</text>')
        if ratio is None:
            out.append(f'<text x="{left + 4}" y="{y + 14}" fill="#999">not measured</text>')
            continue
        x0, x1 = x(1), x(ratio)
        color = "#2b7a3d" if ratio >= (target or 1) else "#c0392b"
        out.append(f'<rect x="{min(x0, x1):.1f}" y="{y + 3}" width="{abs(x1 - x0):.1f}" height="{row - 8}" fill="{color}"/>')
        out.append(f'<text x="{max(x0, x1) + 4:.1f}" y="{y + 14}" fill="#111">{escape(fmt_ratio(ratio))}</text>')
        if target:
            tx = x(target)
            out.append(f'<line x1="{tx:.1f}" y1="{y + 1}" x2="{tx:.1f}" y2="{y + row - 3}" stroke="#000" '
                       f'stroke-width="2" stroke-dasharray="3,2"/>')
    out.append(f'<text x="10" y="{height - 8}" fill="#555">green: target met (dashed mark = target), red: below '
               f'target or slower than the peer. Generated by bench/peers/report.py.</text>')
    out.append("</svg>")
    return "\n".join(out)


def escape(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def issue_21_additions(measurements, unavailable, report):
    """The drop-in proxy beside the LiteLLM proxy, the added p99 at a fixed rate beside the
    simulator's own and one fsync, and the agent step over HTTP: tables and target verdicts."""
    lines = ["#### Issue 21: drop-in proxy, added latency at a fixed rate, agent step over HTTP", ""]
    lines += ["| measurement | figure | target | verdict |", "| --- | --- | --- | --- |"]

    def target(wording, figure, limit, verdict):
        report["targets"].append({"target": wording, "figure": figure, "limit": limit, "verdict": verdict})
        lines.append(f"| {wording} | {figure} | {limit} | {verdict} |")

    proxy = measurements.get(("gateway", "turnstile_proxy"))
    litellm = [measurements[("gateway", p)]["median"] for p in ("litellm_proxy", "litellm_proxy_2w")
               if ("gateway", p) in measurements]
    if proxy and litellm:
        value = min(litellm) / proxy["median"]
        target("drop-in proxy (`/v1/chat/completions`) ≥ 20× the LiteLLM proxy",
               f"{1 / proxy['median']:,.0f} req/s = {fmt_ratio(value)}", "≥ 20×",
               "**met**" if value >= 20 else "**missed**")
    else:
        reason = unavailable.get(("gateway", "turnstile_proxy"), "no LiteLLM figure in this run" if proxy else "not run")
        target("drop-in proxy ≥ 20× the LiteLLM proxy", "—", "≥ 20×", f"not measured ({reason[:80]})")
    floor = next((r for (w, s_), r in measurements.items() if w.startswith("rate/") and s_ == "direct_stream_rate"), None)
    fsync = {label: measurements.get(("fsync", label)) for label in ("fsync_disk", "fsync_tmpfs")}
    for system, store, fsync_label in (("turnstile_serve_rate", "disk", "fsync_disk"),
                                       ("turnstile_serve_tmpfs_rate", "tmpfs", "fsync_tmpfs")):
        record = next((r for (w, s_), r in measurements.items() if w.startswith("rate/") and s_ == system), None)
        if not record or not floor:
            target(f"added p99 at 200 req/s ({store})", "—", "", "not measured")
            continue
        if record["extra"].get("errors") or floor["extra"].get("errors"):
            target(f"added p99 at 200 req/s ({store})", "—", "",
                   f"**missed**: {record['extra'].get('errors', 0)} failed requests "
                   f"({floor['extra'].get('errors', 0)} on the simulator)")
            continue
        if store == "disk" and not fsync[fsync_label]:
            target(f"added p99 at 200 req/s ({store})", "—", "", "not measured (no fsync probe)")
            continue
        p99 = statistics.median(record["extra"]["p99_s"])
        base = statistics.median(floor["extra"]["p99_s"])
        added = p99 - base
        one_fsync = fsync[fsync_label]["median"] if fsync[fsync_label] else 0.0
        limit = (one_fsync + 0.001) if store == "disk" else 0.001
        wording = f"added p99 at {record['extra']['rate_per_s']:g} req/s, {store}"
        figure = (f"{added * 1e3:.2f} ms ({p99 * 1e3:.2f} ms vs the simulator's {base * 1e3:.2f} ms; "
                  f"p50 {statistics.median(record['extra']['p50_s']) * 1e3:.2f} ms)")
        bound = f"≤ {limit * 1e3:.2f} ms" + (f" (one fsync {one_fsync * 1e3:.2f} ms + 1 ms)" if store == "disk" else "")
        target(wording, figure, bound, "**met**" if added <= limit else "**missed**")
    steps = {int(w.split("/")[1]): r for (w, s_), r in measurements.items() if w.startswith("http_step/")}
    for (workload, system), reason in unavailable.items():
        if workload.startswith(("http_step/", "rate/")) or system == "turnstile_proxy":
            lines.append(f"| {workload} ({system}) | not measured: {reason[:100]} | | |")
    if steps:
        for blocks in sorted(steps):
            record = steps[blocks]
            lines.append(f"| agent step over HTTP, {blocks:,} blocks (append + dispatch; dispatch alone) | "
                         f"{fmt_time(record['median'])}; {fmt_time(statistics.median(record['extra']['dispatch_s']))} | | |")
        if 20 in steps and 2000 in steps:
            growth = steps[2000]["median"] / steps[20]["median"]
            lines.append(f"| agent step over HTTP: step(2,000) / step(20) | {fmt_ratio(growth)} | "
                         f"(the in-process target is ≤ 3×) | reported |")
    lines.append("")
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", required=True)
    parser.add_argument("--meta", required=True)
    parser.add_argument("--env", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--svg")
    args = parser.parse_args()
    meta = json.load(open(args.meta))
    env = json.load(open(args.env))
    measurements, unavailable, probes = load(args.results)

    report = {"env": env, "workloads": {}, "targets": [], "probe": {}}
    lines = []
    for workload in workloads(measurements):
        rows = table(workload, measurements, unavailable, meta)
        report["workloads"][workload] = rows
        lines += [f"#### {title(workload, meta)}", "", markdown_table(workload, rows, meta), ""]

    def ratio(workload, system):
        for row in report["workloads"].get(workload, []):
            if row["system"] == system:
                return row.get("ratio")
        return None

    lines += ["#### Targets", "", "| target | measured | verdict |", "| --- | --- | --- |"]
    for workload, peer, minimum, wording in TARGETS:
        candidates = [ratio(workload, p) for p in (peer if isinstance(peer, tuple) else (peer,))]
        candidates = [c for c in candidates if c is not None]
        value = min(candidates) if candidates else None
        verdict = "not measured" if value is None else ("**met**" if value >= minimum else "**missed**")
        report["targets"].append({"target": wording, "ratio": value, "minimum": minimum, "verdict": verdict})
        lines.append(f"| {wording} | {fmt_ratio(value) if value else '—'} | {verdict} |")
    extra = measurements.get(("gateway", "turnstile_serve_extra_sim"))
    if extra:
        for peer, minimum, wording in ((("litellm_proxy", "litellm_proxy_2w"), 20, "≥ 20× the LiteLLM proxy"),
                                       (("tensorzero_embedded",), 1, "above TensorZero's embedded round trip")):
            values = [measurements[("gateway", p)]["median"] / extra["median"] for p in peer if ("gateway", p) in measurements]
            if values:
                value = min(values)
                verdict = "**met**" if value >= minimum else "**missed**"
                text = f"gateway throughput {wording}, against the TCP_NODELAY simulator build"
                report["targets"].append({"target": text, "ratio": value, "minimum": minimum, "verdict": verdict})
                lines.append(f"| {text} | {fmt_ratio(value)} | {verdict} |")
    # Issue 21: the step must grow little with the history: step(2,000) ≤ 3 × step(20).
    small, large = measurements.get(("step/20", "turnstile")), measurements.get(("step/2000", "turnstile"))
    if small and large:
        growth = large["median"] / small["median"]
        verdict = "**met**" if growth <= 3 else "**missed**"
        wording = "agent step grows little with the history: step(2,000) ≤ 3 × step(20)"
        report["targets"].append({"target": wording, "ratio": growth, "maximum": 3, "verdict": verdict})
        lines.append(f"| {wording} | {fmt_ratio(growth)} ({fmt_time(large['median'])} / {fmt_time(small['median'])}) | {verdict} |")
    for workload in workloads(measurements):
        if not workload.startswith("stream/"):
            continue
        peer_ratios = [(ratio(workload, p), p) for p in PEERS_STREAM if ratio(workload, p) is not None]
        if not peer_ratios:
            continue
        fastest_ratio, fastest = min(peer_ratios)
        wording = f"stream assembly ≥ {STREAM_TARGET}× the fastest peer ({workload.split('/', 1)[1]})"
        verdict = "**met**" if fastest_ratio >= STREAM_TARGET else "**missed**"
        report["targets"].append({"target": wording, "ratio": fastest_ratio, "peer": fastest, "minimum": STREAM_TARGET,
                                  "verdict": verdict})
        lines.append(f"| {wording} | {fmt_ratio(fastest_ratio)} vs {NAMES[fastest]} | {verdict} |")
    lines.append("")
    lines += issue_21_additions(measurements, unavailable, report)

    lines += ["#### Correctness probe: the same six bad inputs", "",
              "| system | " + " | ".join(c.replace("_", " ") for c in CASES) + " |",
              "| --- | " + " | ".join("---" for _ in CASES) + " |"]
    for system in PROBE_SYSTEMS:
        cells = []
        for case in CASES:
            if system == "tensorzero" and case == "cut_stream/anthropic":
                cells.append("— (probed through the OpenAI-compatible provider only)")
                report["probe"][f"{system}/{case}"] = None
                continue
            if system == "litellm_modify_params" and case.startswith("cut_stream"):
                # modify_params changes request building only; the stream path is the same.
                obs = probes.get((system, case))
            else:
                obs = probes.get((system, case))
            verdict, detail = classify(system, case, obs)
            report["probe"][f"{system}/{case}"] = {"verdict": verdict, "detail": detail, "observation": obs}
            cells.append(f"**{verdict}**: {escape(detail)}".replace("|", "\\|"))
        lines.append(f"| {PROBE_NAMES[system]} | " + " | ".join(cells) + " |")
    lines.append("")

    bars = []
    for workload in workloads(measurements):
        family = workload.split("/")[0]
        peers = {"prepare": PEERS_PREPARE, "step": PEERS_STEP, "stream": PEERS_STREAM, "gateway": PEERS_GATEWAY}[family]
        for peer in peers:
            if (workload, peer) not in measurements and (workload, peer) not in unavailable:
                continue
            target = None
            for t_workload, t_peer, minimum, _ in TARGETS:
                if t_workload == workload and peer in (t_peer if isinstance(t_peer, tuple) else (t_peer,)):
                    target = minimum
            if family == "stream":
                target = STREAM_TARGET
            bars.append((f"{workload} · {NAMES[peer]}", ratio(workload, peer), target))
    extra = measurements.get(("gateway", "turnstile_serve_extra_sim"))
    if extra:
        for peer in PEERS_GATEWAY:
            if ("gateway", peer) in measurements:
                target = 20 if peer.startswith("litellm") else 1
                bars.append((f"gateway, TCP_NODELAY sim build · {NAMES[peer]}",
                             measurements[("gateway", peer)]["median"] / extra["median"], target))
    subtitle = (f"{env.get('date', '')}, {env.get('cpu', '')}, {env.get('cores', '')} cores; "
                f"load average {env.get('load_start', '')} → {env.get('load_end', '')}")
    svg = svg_chart(bars, subtitle)
    with open(f"{args.out}/ratios.svg", "w") as handle:
        handle.write(svg)
    if args.svg:
        with open(args.svg, "w") as handle:
            handle.write(svg)
    with open(f"{args.out}/results.json", "w") as handle:
        json.dump(report, handle, indent=1)
    with open(f"{args.out}/report.md", "w") as handle:
        handle.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

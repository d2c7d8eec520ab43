"""gpu_check.md: the GPU check's JSON (gpu_check.json) as tables a reader can scan."""
from __future__ import annotations


def _ms(row: dict, key: str) -> str:
    if key in row:
        return f"{row[key]:.3f}"
    err = row.get("error") or (row.get("backward_error") if key == "forward_backward_ms" else None)
    return f"({err[:60]})" if err else ""


def benchmark_table(rows: list[dict]) -> list[str]:
    """One line per row: shape, variant, provider, ms, first call, difference from ours, published, model."""
    lines = ["| shape | variant | provider | fwd ms | fwd+bwd ms | first calls s | rel. diff from ours "
             "| published H100 fla / Helion fwd+bwd | model fwd / fwd+bwd |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        first = "/".join(f"{r[k]:.1f}" for k in ("first_forward_s", "first_forward_backward_s") if k in r)
        diff = f"{r['rel_diff_from_ours']:.1e}" if "rel_diff_from_ours" in r else ""
        pub = ""
        if "published_h100_fla_ms" in r:
            pub = f"{r['published_h100_fla_ms']['forward_backward']:.3f} / {r['published_h100_helion_ms']['forward_backward']:.3f}"
        model = f"{r['model_ms']['forward']:.3f} / {r['model_ms']['forward_backward']:.3f}" if "model_ms" in r else ""
        who = r["provider"] + (f" {r['fla_op']}" if "fla_op" in r else "")
        lines.append(f"| {r['shape']} | {r['variant']} | {who} | {_ms(r, 'forward_ms')} | {_ms(r, 'forward_backward_ms')} "
                     f"| {first} | {diff} | {pub} | {model} |")
    return lines


def profile_table(name: str, prof: dict) -> list[str]:
    """The measured kernels of one profiled fwd+bwd, paired with the model's launches where it has them."""
    lines = [f"### Profile: {prof.get('shape', '')} {name} ({prof.get('provider', '')})", "",
             f"measured total {prof.get('total_us', 0):.1f} us; model {prof.get('predicted_total_us', '-')} us"
             + (f"; model error: {prof['model_error']}" if "model_error" in prof else ""), ""]
    if "launches" in prof:
        lines += ["| part | kernel | grid | predicted us | measured us |", "| --- | --- | --- | ---: | ---: |"]
        for r in prof["launches"]:
            got = "" if r.get("measured_us") is None else f"{r['measured_us']:.1f}"
            lines.append(f"| {r['part']} | {r['kernel']} | {tuple(r['grid'])} | {r['predicted_us']:.1f} | {got} |")
        lines.append("")
    lines += ["| measured kernel | calls | us |", "| --- | ---: | ---: |"]
    lines += [f"| {k['name'][:90]} | {k['calls']} | {k['us']:.1f} |" for k in prof.get("by_name", [])]
    return lines + [""]


def fla_autotuned_lines(tuned: dict, fastest: int = 4) -> list[str]:
    """fla's autotuned configs (gpu_fla_warm.autotuned): each kernel's choices, then the fastest
    candidates of its last tuning."""
    if not tuned.get("chosen"):
        return []
    lines = ["", "## fla's autotuned configs", "", "| kernel | key | config |", "| --- | --- | --- |"]
    lines += [f"| {r['kernel']} | {r['key']} | {r['config']} |" for r in tuned["chosen"]]
    for kernel, rows in tuned.get("timings", {}).items():
        lines += ["", f"{kernel}, last tuning, fastest of {len(rows)}: "
                  + "; ".join(f"{r['config']} {r['ms']:.3f} ms" for r in rows[:fastest])]
    return lines


def markdown(data: dict) -> str:
    """The whole report: sections and their status, environment, benchmark, profiles, checks."""
    sections = data.get("sections", {})
    lines = ["# GPU check", "", f"`{data.get('command', '')}` (budget {data.get('budget_s')} s, "
             f"took {data.get('seconds', '...')} s)", "", "| section | status | seconds | note |", "| --- | --- | ---: | --- |"]
    for name, res in sections.items():
        if name != "summary":
            note = res.get("reason") or res.get("error") or res.get("summary") or ""
            lines.append(f"| {name} | {res.get('status')} | {res.get('seconds', '')} | {str(note)[:120]} |")
    env = sections.get("environment", {})
    if env:
        lines += ["", "## Environment", "", "| | |", "| --- | --- |"]
        lines += [f"| {k} | {str(v).replace(chr(10), ' ')[:300]} |" for k, v in env.items()
                  if k not in ("status", "seconds", "traceback")]
    bench = sections.get("benchmark", {})
    if bench.get("rows"):
        lines += ["", f"## Benchmark ({bench.get('timer', '')}; published: {bench.get('published_source', '')})", ""]
        lines += benchmark_table(bench["rows"])
        if bench.get("plan_misses"):
            lines += ["", f"Compiled by the JIT outside the precompiled plan: {', '.join(bench['plan_misses'])}"]
    lines += fla_autotuned_lines(bench.get("fla_autotuned", {}))
    for name, prof in sections.get("profile", {}).items():
        if isinstance(prof, dict) and "by_name" in prof:
            lines += [""] + profile_table(name, prof)
    for name in ("selftest", "kernel tests"):
        res = sections.get(name, {})
        failed = [c for c in res.get("checks", []) if c.get("status") == "failed"]
        if failed:
            lines += ["", f"## {name}: failures", "", "| check | dtype | problems |", "| --- | --- | --- |"]
            lines += [f"| {c['name']} | {c['dtype']} | {'; '.join(c['problems'])[:200]} |" for c in failed]
        if res.get("failed_tests"):
            lines += ["", f"## {name}: failed", ""] + [f"* {t}" for t in res["failed_tests"]]
    return "\n".join(lines) + "\n"

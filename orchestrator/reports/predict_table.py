"""The table ``tracefleet-predict`` prints: one prediction (orchestrator/studies/predict.py) for people."""
from __future__ import annotations

from orchestrator.reports.not_run import not_run_lines
from orchestrator.reports.predict_notes import breakdown_help, kernel_lines, outside_breakdown
from orchestrator.units import human_bytes


def _job_line(p: dict) -> str:
    wl, t = p["workload"], p["target"]
    if "trace_dir" in wl:
        what = f"traces {wl['trace_dir']}"
    elif wl["model"] == "custom":  # the recipe knobs do not apply to the user's own step
        what = f"{wl['name']} (your step {wl['entrypoint']})"
    else:
        # the knobs that change the peak most beside the recipe: a compiled job's is not the
        # eager one's (the README's 8B: 76.9 against 82.0 GiB reserved)
        knobs = [name for key, name in (("compile", "compiled per block"), ("float8", "float8"),
                                        ("cpu_offload", "CPU offload"),
                                        ("activation_offload", "activations offloaded"),
                                        ("optimizer_in_backward", "optimizer in backward"),
                                        ("tie_embeddings", "tied embeddings")) if wl.get(key)]
        if wl.get("optimizer", "adamw") != "adamw":
            knobs.append(f"optimizer {wl['optimizer']}")
        if wl.get("loss_chunks", 1) > 1:
            knobs.append(f"loss in {wl['loss_chunks']} chunks")
        if wl.get("reshard_after_forward", "default") != "default":
            knobs.append(f"reshard after forward {wl['reshard_after_forward']}")
        what = f"{wl['name']} ({wl['model']}, {wl['parallel']}, {wl['precision']}, AC " \
               f"{wl['activation_checkpointing']}, local batch {wl['batch_size']} x seq " \
               f"{wl['seq_len']}{''.join(', ' + k for k in knobs)})"
    if p.get("zero3_emulation"):
        z = p["zero3_emulation"]
        what += f", ZeRO-3 emulated ({z['strategy']}, layout {z['layout']})"
    mesh = f", mesh {p['mesh']['description']}" if p.get("mesh") else ""
    return f"{what}{mesh} on {p['world_size']} x {t['name']}"


def _peak_op(op: dict | None) -> str:
    if op is None:
        return "-"
    hook = " (in a ZeRO-3 fetch/release next to it)" if op.get("hook") else ""
    return f"node {op['node_id']} {op['op']}{hook}"


def prediction_table(p: dict) -> str:
    """The prediction as a markdown table, a line naming the job first and the error band,
    the target's figures and the timings after (``*``: predicted by the allocator model)."""
    t = p["target"]
    reserved = p["predicted_reserved_peak_bytes"]
    headroom = p["headroom_bytes"]
    band = p["error_band"] * reserved
    share = f"error band {100 * p['error_band']:g}% of the reserved peak = {human_bytes(band)}"
    rows = [
        ("allocated peak*", human_bytes(p["predicted_allocated_peak_bytes"])),
        *outside_breakdown(p),
        ("reserved peak*", human_bytes(reserved)),
        ("usable capacity", f"{human_bytes(p['usable_capacity_bytes'])} = "
                            f"{human_bytes(t['device_memory_bytes'])} - CUDA context "
                            f"{human_bytes(t['cuda_context_bytes'])} - NCCL "
                            f"{human_bytes(t['nccl_buffer_bytes'])}"),
        ("headroom", f"{human_bytes(headroom)} ({share})"),
        ("verdict", f"**{p['verdict']}**"),
        ("op at the peak", _peak_op(p["peak_op"])),
    ]
    if p.get("host_peak_bytes"):
        rows.append(("host memory (offloaded)", f"{human_bytes(p['host_peak_bytes'])} peak, "
                                                "not in the figures above"))
    if p.get("mesh"):
        m = p["mesh"]
        rows.append(("worst rank", f"rank {p['rank']} ({m['worst_rank_role']}, "
                                   f"{m['ranks_per_role'][m['worst_rank_role']]} rank(s) alike)"))
        if len(p.get("per_role") or ()) > 1:  # pipeline stages, cp ranks: each role's peak
            rows += [(f"reserved peak*: {role}",
                      f"{human_bytes(f['predicted_reserved_peak_bytes'])} (rank {f['rank']})")
                     for role, f in p["per_role"].items()]
    total = sum(p["breakdown"].values()) or 1
    rows += [(f"peak: {name}", f"{human_bytes(b)} ({100 * b / total:.0f}%)")
             for name, b in sorted(p["breakdown"].items(), key=lambda kv: -kv[1]) if b]
    lines = [f"tracefleet-predict: {_job_line(p)}", "", "| what | bytes |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["",
              f"verdict: {p['verdict']} (oom: headroom < 0; too_close: headroom < error band "
              f"{100 * p['error_band']:g}% ({p['error_band_source']}) of the reserved peak)",
              "* predicted by the caching allocator model; the breakdown is of the accounted "
              "peak (tensor bytes by category):"]
    lines += [f"  {name}: {text}" for name, text in breakdown_help(p["breakdown"]).items()]
    lines += kernel_lines(p.get("kernel_dispatch"))
    lines.append("target: " + "; ".join(f"{k} {v}" for k, v in t["defaults"].items()))
    if p["num_predicted_ooms"]:
        lines.append(f"the allocator model ran out {p['num_predicted_ooms']} time(s) after "
                     f"{p['num_alloc_retries']} cache release(s)")
    if p["coverage"] < 1:
        lines.append(f"warning: {100 * (1 - p['coverage']):.1f}% of the recorded ops did not run "
                     "on meta as recorded (named below; prediction.json: not_run_ops)")
    lines += not_run_lines(p.get("not_run_ops"))
    cap, tm = p.get("capture"), p["timings_s"]
    where = "no capture (trace.dir)" if cap is None else \
        f"capture {'reused from ' + cap['dir'] if cap['reused'] else 'on ' + cap['device']}"
    lines.append(f"time: {tm['total_s']:.1f} s ({where}: {tm['capture_s']:.1f} s, dry run "
                 f"{tm['replay_s']:.1f} s for {p['num_distinct_traces']} distinct trace(s))")
    return "\n".join(lines)

"""The checks a careful engineer adds to an envelope, each a Finding when it fails.

Little's law (is the per-replica rate consistent with the ITL target at the concurrency KV
allows?), the stated rates against the roofline, TTFT against the prefill rate, and the cost of
the whole fleet (prefill and headroom included) against the one-replica figure.
"""

from __future__ import annotations

from llmd.plan.inputs import Plan
from llmd.plan.roofline import peak_flops
from llmd.plan.sheet import Sheet, num


def littles_law(s: Sheet, plan: Plan) -> None:
    """Check 1: tokens/s per replica = sequences in flight × tokens/s per sequence, and a sequence
    makes 1 ÷ ITL tokens a second (Little's law, L = λW, with W = ITL per token)."""
    itl = plan.workload.itl_ms
    s.section = "Check: Little's law (tokens/s per replica vs ITL target)"
    if itl is None:
        s.add("little_skipped", "Little's law", "no --itl-ms given: not checked", None, "")
        return
    tps, kv = s["decode_tps"], s["max_seqs_kv"]
    per_seq = s.add("per_seq_tps", "tokens/s per sequence at the ITL target", f"1,000 ÷ {num(itl)} ms", 1e3 / itl,
                    "tok/s")
    busy = s.add("little_seqs", "sequences in flight at that rate", f"{num(tps)} tok/s ÷ {num(per_seq)} tok/s",
                 tps / per_seq, "seqs")
    at_kv = s.add("itl_at_kv", "ITL if the replica runs its KV capacity", f"{num(kv)} seqs ÷ {num(tps)} tok/s",
                  kv / tps * 1e3, "ms")
    need = s.add("tps_for_kv_at_itl", "tokens/s to run its KV capacity at the ITL target",
                 f"{num(kv)} seqs × {num(per_seq)} tok/s", kv * per_seq, "tok/s")
    if at_kv <= itl * 1.1:
        return
    lines = [f"at {num(kv)} sequences: {num(tps)} ÷ {num(kv)} = {num(tps / kv)} tok/s per sequence = "
             f"{num(at_kv)} ms ITL, {at_kv / itl:.1f}× the {num(itl)} ms target",
             f"at {num(itl)} ms each sequence makes 1,000 ÷ {num(itl)} = {num(per_seq)} tok/s, so {num(tps)} tok/s is "
             f"{num(tps)} ÷ {num(per_seq)} = {num(busy)} sequences ({busy / kv:.0%} of the KV capacity)",
             f"running {num(kv)} sequences at {num(itl)} ms takes {num(kv)} × {num(per_seq)} = {num(need)} tok/s"]
    if plan.seed:
        lines.insert(1, f"with the seed's ~500: {num(tps)} ÷ 500 = {num(tps / 500)} tok/s = "
                        f"{num(500 / tps * 1e3)} ms ITL")
    s.flag("littles_law", f"Little's law: {num(tps)} tok/s per replica and ~{num(kv)} sequences per replica cannot "
           f"both hold at a {num(itl)} ms ITL", *lines)


def efficiency(s: Sheet, plan: Plan) -> None:
    """The stated per-replica rates as a fraction of the roofline: far below means a conservative
    figure (or overheads to measure), above means impossible."""
    if plan.deploy.decode_tps is not None and "roofline_decode_tps" in s:
        s.section = "Check: stated rates vs the roofline"
        tps, roof = s["decode_tps"], s["roofline_decode_tps"]
        r = s.add("decode_efficiency", "decode rate as a fraction of the roofline", f"{num(tps)} ÷ {num(roof)} × 100",
                  tps / roof * 100, "%") / 100
        if r < 0.3 or r > 1:
            verdict = ("exceeds what the hardware can do" if r > 1 else
                       f"so either it is conservative (up to {1 / r:.0f}× fewer decode replicas would do) or it "
                       "includes per-step overheads the roofline omits: measure them (`llmd plan calibrate`)")
            s.flag("decode_efficiency", f"the stated {num(tps)} tok/s per replica is {r:.0%} of the roofline estimate",
                   f"roofline at {num(s['max_seqs'])} sequences: {num(roof)} tok/s; {num(tps)} ÷ {num(roof)} = {r:.1%}",
                   verdict)
    if plan.deploy.prefill_tps is not None and "prefill_flops_token" in s:
        s.section = "Check: stated rates vs the roofline"
        tp = int(s["tp"])
        peak, cd = peak_flops(plan)
        if peak is None:
            return
        mfu = s.add("prefill_mfu", "prefill MFU the stated rate implies",
                    f"{num(s['prefill_tps'])} tok/s × {num(s['prefill_flops_token'])} GFLOP ÷ ({tp} × "
                    f"{num(peak / 1e12)} TFLOPs {cd}) × 100",
                    s["prefill_tps"] * s["prefill_flops_token"] * 1e9 / (tp * peak) * 100, "%") / 100
        if mfu > 1:
            s.flag("prefill_mfu", f"the stated prefill rate needs {mfu:.0%} of peak FLOPs: impossible")


def ttft(s: Sheet, plan: Plan) -> None:
    """A prompt's own prefill time at the stated rate, before any queueing, against the TTFT target."""
    target = plan.workload.ttft_ms
    if target is None:
        return
    s.section = "Check: TTFT target vs prefill rate"
    t = s.add("prefill_time", "prefill time of a mean prompt (no queueing)",
              f"{num(plan.workload.prompt_tokens)} tok ÷ {num(s['prefill_tps'])} tok/s", plan.workload.prompt_tokens
              / s["prefill_tps"] * 1e3, "ms", f"TTFT target {num(target)} ms")
    if t > target:
        s.flag("ttft", f"a mean prompt alone takes {num(t)} ms to prefill, over the {num(target)} ms TTFT target")

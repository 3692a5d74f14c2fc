"""Check 3: what a million tokens costs, the seed's way and the whole fleet's way.

The seed's $2.2 is one decode replica's price over its own output at full use:
$16/h ÷ (2,000 tok/s × 3,600 s) = $2.22 per million, and ÷ 40 % = $5.56 ("~$6"). A fleet pays for
its prefill replicas and its headroom too, and runs at its mean load, not its peak.
"""

from __future__ import annotations

from llmd.plan.inputs import Plan
from llmd.plan.sheet import Sheet, num, usd


def _price(s: Sheet, plan: Plan) -> float | None:
    d = plan.deploy
    if d.price_per_hour is not None:
        return s.add("price_per_replica", "price per replica", "given", d.price_per_hour, "$/h")
    if d.gpu.price_per_hour is None:
        s.add("price_per_replica", "price per replica", "", None, "$/h", f"{d.gpu.price_source}")
        return None
    tp = int(s["tp"])
    return s.add("price_per_replica", "price per replica", f"{tp} × {usd(d.gpu.price_per_hour)}/GPU-h", tp
                 * d.gpu.price_per_hour, "$/h", d.gpu.price_source)


def cost_lines(s: Sheet, plan: Plan) -> None:
    """The one-replica formula (the seed's), then the whole fleet per output and per total token."""
    s.section = "Check: cost per million tokens"
    price = _price(s, plan)
    if price is None:
        return
    u, tps = plan.deploy.avg_util, s["decode_tps"]
    one = s.add("seed_cost_full", "one decode replica at full use (the seed's formula)",
                f"{usd(price)}/h ÷ ({num(tps)} tok/s × 3,600 s ÷ 1e6)", price / (tps * 3600 / 1e6), "$/M tok")
    at_u = s.add("seed_cost_at_util", f"the same at {u:.0%} use", f"{usd(one)} ÷ {u:g}", one / u, "$/M tok")
    fleet, out, pin = s["fleet_replicas"], s["output_tps"], s["prompt_tps"]
    hour = s.add("fleet_cost_hour", "the whole fleet per hour", f"{num(fleet)} replicas × {usd(price)}/h",
                 fleet * price, "$/h")
    peak = s.add("fleet_cost_output", "whole fleet per million output tokens at peak load",
                 f"{usd(hour)}/h ÷ ({num(out)} tok/s × 3,600 s ÷ 1e6)", hour / (out * 3600 / 1e6), "$/M tok")
    mean = s.add("fleet_cost_output_avg", f"the same at {u:.0%} mean load", f"{usd(peak)} ÷ {u:g}", peak / u,
                 "$/M tok", "the fleet is sized for the peak and paid for all day")
    s.add("fleet_cost_all_tokens", "whole fleet per million tokens, prompt + output, at peak",
          f"{usd(hour)}/h ÷ (({num(out)} + {num(pin)}) tok/s × 3,600 s ÷ 1e6)", hour / ((out + pin) * 3600 / 1e6),
          "$/M tok")
    if mean > at_u * 1.1:
        dec, pre = s["decode_replicas"], s["prefill_replicas"]
        s.flag("fleet_cost", f"{usd(one)}/M ({usd(at_u)} at {u:.0%}) prices one decode replica's own output; the whole "
               f"fleet costs {usd(peak)}/M output tokens at peak, {usd(mean)} at {u:.0%}: {mean / at_u:.1f}×",
               f"the fleet is {num(fleet)} replicas, not {num(dec)}: + {num(pre)} prefill + {num(fleet - dec - pre)} "
               f"headroom = {num(fleet)} ÷ {num(dec)} = {fleet / dec:.2f}× the decode replicas' cost",
               f"{num(fleet)} × {usd(price)}/h = {usd(hour)}/h ÷ {num(out * 3600 / 1e6)} M output tok/h = "
               f"{usd(peak)}/M; ÷ {u:g} = {usd(mean)}/M",
               f"counting prompt tokens too: {usd(hour)}/h ÷ {num((out + pin) * 3600 / 1e6)} M tok/h = "
               f"{usd(s['fleet_cost_all_tokens'])}/M")

"""Experiment 1: at batch 1 a forward reads every weight once but does little arithmetic, so
checking k + 1 positions costs about what generating one costs, on a GPU."""

from __future__ import annotations

from ..errors import SpecDecodeError
from ..roofline import DTYPE_BYTES, HARDWARE, ModelSpec, forward_time, measure_cpu, spec_from_path
from .common import LabConfig, LabResult, Table, decode_step_seconds, label, new_figure

ANCHOR_PARAMS = 25.63e9  # the lesson's ~26B-parameter bf16 anchor model (15.30 ms on H100 SXM)


def model_spec(model: str | None, params: float | None, dtype: str) -> ModelSpec:
    if dtype not in DTYPE_BYTES:
        raise SpecDecodeError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    if model is not None:
        from ..models import resolve

        return spec_from_path(resolve(model), dtype)
    n = ANCHOR_PARAMS if params is None else params
    if n <= 0:
        raise SpecDecodeError(f"--params must be > 0, got {n}")
    return ModelSpec(f"{n / 1e9:.3g}B parameters", n, DTYPE_BYTES[dtype])


def run(
    cfg: LabConfig,
    model: str | None = None,
    params: float | None = None,
    dtype: str = "bf16",
    k: int = 4,
    measure: bool = True,
) -> LabResult:
    spec = model_spec(model, params, dtype)
    cpu = measure_cpu()
    chips = [*HARDWARE.values(), cpu]
    rows, data = [], {"model": spec.name, "params": spec.params, "dtype": dtype, "k": k, "hardware": {}}
    for hw in chips:
        one = forward_time(spec, hw, 1)
        many = forward_time(spec, hw, k + 1)
        rows.append(
            [
                hw.name,
                one["compute_s"] * 1e3,
                one["memory_s"] * 1e3,
                many["compute_s"] * 1e3,
                many["time_s"] / one["time_s"],
                one["bound"],
                hw.ridge,
            ]
        )
        data["hardware"][hw.name] = {
            "peak_flops": hw.peak_flops,
            "bandwidth": hw.bandwidth,
            "source": hw.source,
            "compute_ms_1": one["compute_s"] * 1e3,
            "weight_read_ms_1": one["memory_s"] * 1e3,
            f"compute_ms_{k + 1}": many["compute_s"] * 1e3,
            f"weight_read_ms_{k + 1}": many["memory_s"] * 1e3,
            "verify_cost_ratio": many["time_s"] / one["time_s"],
        }
    tables = [
        Table(
            f"roofline lower bounds per forward at batch 1: {spec.name}, {dtype} "
            f"({spec.weight_bytes / 1e9:.3g} GB of weights)",
            [
                "hardware",
                "compute ms (1 pos)",
                "weight read ms",
                f"compute ms ({k + 1} pos)",
                f"T({k + 1})/T(1)",
                "bound",
                "ridge FLOP/B",
            ],
            rows,
            "compute = 2·params·positions / peak FLOPs; weight read = params·bytes / bandwidth; a forward "
            "takes at least the larger. The cpu row is measured on this machine (copy bandwidth, "
            "fp32 matmul).",
        )
    ]
    checks = {}
    if measure:
        # what our own engine's forward really costs here, for the target we ship
        lm = cfg.model(cfg.target)
        local = spec_from_path(lm.path, "fp32")
        t1 = decode_step_seconds(lm, tokens=1)
        tk = decode_step_seconds(lm, tokens=k + 1)
        b1, bk = forward_time(local, cpu, 1), forward_time(local, cpu, k + 1)
        data["measured_cpu"] = {
            "model": label(cfg.target),
            "params": local.params,
            "ms_1": t1 * 1e3,
            f"ms_{k + 1}": tk * 1e3,
            "bound_ms_1": b1["time_s"] * 1e3,
            f"bound_ms_{k + 1}": bk["time_s"] * 1e3,
            "verify_cost_ratio": tk / t1,
        }
        tables.append(
            Table(
                f"measured here: {label(cfg.target)} ({local.params / 1e6:.2f}M params, fp32) in our runtime",
                ["positions", "measured ms", "roofline bound ms", "measured / bound"],
                [
                    [1, t1 * 1e3, b1["time_s"] * 1e3, t1 / b1["time_s"]],
                    [k + 1, tk * 1e3, bk["time_s"] * 1e3, tk / bk["time_s"]],
                ],
                f"verification cost ratio T({k + 1})/T(1) = {tk / t1:.2f}. A model this small is far from "
                "its roofline on a CPU: per-layer overheads, not bytes or operations, dominate.",
            )
        )
    h100 = data["hardware"][HARDWARE["h100-sxm"].name]
    if model is None and params is None and dtype == "bf16":
        checks["anchor_h100_weight_read_15.30ms"] = abs(h100["weight_read_ms_1"] - 15.30) < 0.05
        checks["anchor_h100_compute_0.052ms"] = abs(h100["compute_ms_1"] - 0.052) < 0.001
    checks["gpu_verify_nearly_free"] = all(
        data["hardware"][hw.name]["verify_cost_ratio"] < 1.01 for hw in HARDWARE.values()
    )
    return LabResult(
        "roofline",
        "1. roofline: why verifying k + 1 tokens costs about one forward",
        "At batch 1 every weight is read once per forward, but each weight does only 2 operations per "
        "position. On a GPU the weight read takes hundreds of times longer than the arithmetic, so "
        f"running {k + 1} positions instead of 1 leaves the forward's time unchanged: the target can "
        "check k draft tokens for the price of generating one. Read the table across: the compute "
        "column grows with positions, the weight-read column does not, and the forward takes the "
        "larger of the two. The ratio T(k+1)/T(1) is what speculative decoding needs to be near 1.",
        "lesson 000: a ~26B bf16 model on H100 SXM needs ≈0.052 ms of compute vs ≈15.30 ms of weight "
        "read per token; 5 positions ≈0.26 ms of compute.",
        tables,
        data,
        checks,
        _plot(spec, chips, k),
    )


def _plot(spec: ModelSpec, chips, k: int):
    import numpy as np

    fig, ax = new_figure(figsize=(7, 4.5))
    x = np.logspace(-1, 4, 200)
    for hw in chips:
        (line,) = ax.loglog(x, np.minimum(hw.peak_flops, x * hw.bandwidth) / 1e12, label=hw.name)
        for pos, marker in ((1, "o"), (k + 1, "s")):
            t = forward_time(spec, hw, pos)
            intensity = t["flops"] / t["bytes"]
            ax.loglog(intensity, t["flops"] / t["time_s"] / 1e12, marker, color=line.get_color())
    ax.set_xlabel("arithmetic intensity (operations per byte read)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"roofline: {spec.name}; circle = 1 position, square = {k + 1}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return fig

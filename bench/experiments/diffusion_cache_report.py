"""The report of `pagemesh experiment diffusion-cache` (the runs are diffusion_cache.py's), also
diffusion-cache-deep's and diffusion-unet-cache's: the speed/fidelity table, each cache beside
fewer steps at equal compute, the load test, the public figures, and the verdict, all from the
measured points. What it says of the model (a DiT split into transformer blocks, or a U-Net split
for DeepCache) is `describe`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagemesh.bench.experiments.report import Report, new_figure
from pagemesh.workers.diffusion.engine.cache_policy import COOLDOWN_STEPS, WARMUP_STEPS

KINDS = {"interval": "interval (DeepCache/FORA)", "fbcache": "First-Block-Cache", "teacache": "TeaCache"}
STYLE = {"interval": "o-", "fbcache": "s-", "teacache": "^-", "steps": "k--x"}
# Each checked against the source in its last cell (December 2026), or marked "not confirmed".
ANCHORS = [
    (
        "DeepCache (Ma et al., CVPR 2024)",
        "SD 1.5, U-Net, 50 PLMS steps",
        "2.3×",
        "−0.05 CLIP score",
        "arXiv 2312.00858, abstract; 50 PLMS: the repository README",
    ),
    (
        "TeaCache (Liu et al.)",
        "Open-Sora-Plan, video DiT",
        "up to 4.41×",
        "−0.07% VBench",
        "arXiv 2411.19108, abstract",
    ),
    (
        "First-Block-Cache (ParaAttention)",
        "FLUX.1-dev, 28 steps, threshold 0.08, one L20",
        "1.55× (26.36 → 17.01 s)",
        "'nearly zero quality loss'",
        "diffusers docs, optimization/para_attn.md (ParaAttention's own benchmark)",
    ),
    (
        "cache-dit (DBCache)",
        "FLUX.1-dev, 50 steps, DrawBench: F8B0 R0.08 / F4B0 MC3 R0.12",
        "1.80× / 2.47× (TFLOPs)",
        "ImageReward 1.037 / 1.013 (full run 1.041)",
        "vipshop/cache-dit bench/README.md",
    ),
    (
        "cache-dit equal-compute table",
        "FLUX.1-dev: fewer steps vs good caches",
        "1.67× / 3.13× vs 2.7–4×",
        "ImageReward 0.966 / 0.945 vs ≈ 1.0",
        "not confirmed: not found in the cache-dit README or bench/README.md versions searched",
    ),
]


@dataclass(frozen=True, kw_only=True)
class ModelText:
    """What the report says about the model its sweeps ran on."""

    title: str
    header: str  # the header's model cell
    about: str  # what speed and fidelity mean here (the experiment module's doc after its first paragraph)
    split: str  # what each policy always runs
    blocks: int  # blocks of the split (num_blocks)
    unet: bool  # a U-Net's DeepCache split (deep_cache_forward), else a DiT's blocks (block_forward)
    shallow_blocks: int = 0  # U-Net: blocks a reusing row still runs
    shallow_share: float = math.nan  # U-Net: the shallow path's share of the parameters
    side: int = 0  # U-Net: the latents' side (the shallow path's resolution)


def _precision(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(name, name)


def describe(pipeline) -> ModelText:
    """A DiT pipeline (`block_forward`: transformer blocks of `pipeline.transformer`) or a U-Net one
    (no block_forward, a `deep_cache_forward`: the down/mid/up blocks of `pipeline.unet`)."""
    if getattr(pipeline, "block_forward", None) is not None:
        from pagemesh.bench.experiments import diffusion_cache

        blocks = pipeline.block_forward.num_blocks
        params = sum(p.numel() for p in pipeline.transformer.parameters())
        return ModelText(
            title="Feature caching vs fewer steps: per-request caches inside step batches",
            header=f"{pipeline.name}: {blocks}-layer DiT, 16 tokens, {params / 1e6:.2f} M parameters "
            f"({_precision(pipeline.dtype)})",
            about=diffusion_cache.__doc__.split("\n\n", 1)[1],
            split="interval and First-Block-Cache always run block 0, TeaCache skips the whole stack.",
            blocks=blocks,
            unet=False,
        )
    split = getattr(pipeline, "deep_cache_forward", None)
    if split is None:
        raise ValueError(f"{pipeline.name} has neither a block_forward nor a deep_cache_forward: nothing to cache")
    from pagemesh.bench.experiments import diffusion_unet_cache

    unet = pipeline.unet
    params = sum(p.numel() for p in unet.parameters())
    shallow = sum(p.numel() for block in (unet.down_blocks[0], unet.up_blocks[-1]) for p in block.parameters())
    channels, side, _ = pipeline.latent_shape
    return ModelText(
        title="DeepCache vs fewer steps on a U-Net: per-request caches inside step batches",
        header=f"{pipeline.name}: {split.num_blocks}-block U-Net (down/mid/up blocks), {channels}×{side}×{side} "
        f"pixels, {params / 1e6:.2f} M parameters ({_precision(pipeline.dtype)})",
        about=diffusion_unet_cache.__doc__.split("\n\n", 1)[1],
        split="DeepCache (interval:N) runs the shallow path (the first down block and the last up block) at every "
        "step and the deep branch every N-th step.",
        blocks=split.num_blocks,
        unet=True,
        shallow_blocks=split.shallow_blocks,
        shallow_share=shallow / params,
        side=side,
    )


def kinds_of(points: list) -> list[str]:
    """The cache kinds the points hold, in KINDS order (a U-Net has interval only), then "steps"."""
    present = {p.kind for p in points}
    return [kind for kind in KINDS if kind in present] + ["steps"]


def equal_compute(points: list) -> list[tuple]:
    """(cache point, its fewer-steps twin: the step count of the same block fraction)."""
    out = []
    for sampler in dict.fromkeys(p.sampler for p in points):
        mine = [p for p in points if p.sampler == sampler]
        full = next(p for p in mine if p.kind == "none")
        twins = {p.steps: p for p in mine if p.kind == "steps"}
        for p in mine:
            twin = twins.get(max(1, round(p.fraction * full.steps)))
            if p.kind in KINDS and twin is not None:
                out.append((p, twin))
    return out


BARS = (40.0, 35.0, 30.0)  # PSNR bars (dB); on 8x8 uint8 digits 35 dB is an RMS error of 4.5 grey levels


def fraction_at(curve: list, bar: float) -> tuple[float, str]:
    """The least block fraction at which a method's PSNR reaches `bar`, interpolated linearly
    between its measured settings (PSNR rises with the fraction); ('', '≥'/'<') marks a bar met
    by its cheapest setting already (a lower bound on the speed-up) or by none but the full run."""
    curve = sorted((p.fraction, p.psnr) for p in curve)
    if curve[0][1] >= bar:
        return curve[0][0], "≥ "
    for (f0, q0), (f1, q1) in zip(curve, curve[1:]):
        if q1 >= bar:
            q1 = min(q1, bar + 60.0)  # the full run's ∞
            return f0 + (f1 - f0) * (bar - q0) / (q1 - q0), ""
    return 1.0, "< "


def speedup_rows(points: list) -> list[tuple]:
    rows = []
    for sampler in dict.fromkeys(p.sampler for p in points):
        mine = [p for p in points if p.sampler == sampler]
        full = [p for p in mine if p.kind == "none"]
        for kind in kinds_of(mine):
            curve = [p for p in mine if p.kind == kind] + full
            cells = []
            for bar in BARS:
                fraction, mark = fraction_at(curve, bar)
                cells.append(f"{mark}{1 / fraction:.2f}×")
            rows.append((sampler, KINDS.get(kind, "fewer steps"), *cells))
    return rows


def _fmt_db(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.1f}"


def write_report(ctx, pipeline, judge, points: list, load: list[tuple] | None, load_note: str) -> Report:
    """`load` None: no load section (diffusion-cache-deep, diffusion-unet-cache)."""
    model = describe(pipeline)
    report = Report(
        ctx.name,
        model.title,
        ctx.command,
        model=model.header,
        seed=ctx.seed,
        threads=ctx.threads,
        started=ctx.started,
        load_at_start=ctx.load_at_start,
    )
    from pagemesh.bench.experiments import diffusion_cache

    report.text(model.about)
    samplers = list(dict.fromkeys(p.sampler for p in points))
    images = {s: next(p.images for p in points if p.sampler == s) for s in samplers}
    floors = ", ".join(f"{judge.floor(n):.1f} at {n}" for n in sorted(set(images.values()), reverse=True))
    report.text(
        "Every setting of a sampler generates the same seeded images, "
        + ", ".join(f"{n} for {s}" for s, n in images.items())
        + f" (an equal share of each digit, guidance {diffusion_cache.GUIDANCE:g}, so 2 rows per image), as 10 "
        "requests batched at every step by one engine; `ms/image` is that batch's wall time over its images, "
        "`ms alone` the median of 3 runs of one image alone (dpmsolver++ only). Every policy computes the first 2 "
        f"and the last step in full (engine/cache_policy.py); {model.split} PSNR / SSIM are against the full "
        "uncached run of the same seeds (bench/experiments/image_metrics.py). The FD floor (real training digits "
        f"against the held-out ones): {floors} images."
    )
    rows = [
        (
            p.sampler,
            p.label,
            p.fraction,
            1 / p.fraction,
            p.ms_per_image,
            p.ms_alone,
            _fmt_db(p.psnr),
            p.ssim,
            f"{p.accuracy:.0%}",
            p.fd,
        )
        for p in points
    ]
    headers = ("sampler", "setting", "blocks", "speed-up (blocks)", "ms/image", "ms alone", "PSNR dB", "SSIM")
    report.table((*headers, "accuracy", "FD"), rows, caption="## Speed against fidelity")

    pairs = equal_compute(points)
    pair_rows = [
        (c.sampler, c.label, c.fraction, _fmt_db(c.psnr), c.ssim, c.ms_alone, t.label, t.fraction, _fmt_db(t.psnr))
        + (t.ssim, t.ms_alone, "cache" if c.psnr > t.psnr else "fewer steps")
        for c, t in pairs
    ]
    report.table(
        ("sampler", "cache", "blocks", "PSNR", "SSIM", "ms alone", "fewer steps", "blocks", "PSNR", "SSIM")
        + ("ms alone", "closer to the full run"),
        pair_rows,
        caption="## Each cache beside fewer steps at equal block compute",
    )
    if model.unet:
        report.table(
            ("sampler", "cache", "accuracy", "FD", "ms/image", "ms alone", "fewer steps", "accuracy", "FD")
            + ("ms/image", "ms alone", "lower FD"),
            [
                (c.sampler, c.label, f"{c.accuracy:.0%}", c.fd, c.ms_per_image, c.ms_alone, t.label)
                + (f"{t.accuracy:.0%}", t.fd, t.ms_per_image, t.ms_alone, "cache" if c.fd < t.fd else "fewer steps")
                for c, t in pairs
            ],
            caption="## Class accuracy, FD and wall time at equal block compute\n\nThe same pairs: accuracy and FD "
            "judge the images as digits (not against the full run), `ms/image` is batched (10 requests), `ms alone` "
            "one image alone.",
        )
    report.table(
        ("sampler", "method", *(f"speed-up at {bar:g} dB" for bar in BARS)),
        speedup_rows(points),
        caption="## Block speed-up at equal fidelity\n\nThe fewest block evaluations that reach each PSNR, "
        "interpolated between the measured settings of a method (≥: its cheapest setting already did; <: none did).",
    )
    report.figure("fidelity", _fidelity_figure(points, samplers), "PSNR against the uncached full run.")
    if any(not math.isnan(p.ms_alone) for p in points):
        report.figure("wall", _wall_figure(points), "dpmsolver++: PSNR against the wall time of one image alone.")
    if model.unet:
        report.figure(
            "batched", _batched_figure(points, samplers), "PSNR against the wall time per image, 10 requests batched."
        )
        report.figure("fd", _fd_figure(points, samplers), "FD to the held-out digits against the block fraction.")

    if load is not None:
        report.table(
            ("arrivals", "worker cache", "images/s", "images/s, rounds", "p50 ms", "p99 ms", "blocks", "rows/forward"),
            load,
            caption=f"## Step-level batching under load, caching on and off\n\n{load_note}",
        )
        report.figure("load", _load_figure(load), "Latency under Poisson arrivals, each worker-default policy.")
    anchors = [row for row in ANCHORS if row[0].startswith("DeepCache")] if model.unet else ANCHORS
    report.table(
        ("work", "model / setting", "speed-up", "quality cost", "source"), anchors, caption="## Public figures"
    )
    report.text(verdict(points, pairs, load, model))
    report.key = key_line(points, ctx.name)
    return report


def verdict(points: list, pairs: list[tuple], load: list[tuple] | None, model: ModelText) -> str:
    lines = ["## Which wins where", ""]
    for sampler, method, *cells in speedup_rows(points):
        if method == "fewer steps":
            continue
        steps = next(r for r in speedup_rows(points) if r[0] == sampler and r[1] == "fewer steps")
        lines.append(
            f"- {sampler}, {method}: {cells[1]} fewer blocks at {BARS[1]:g} dB, fewer steps {steps[3]}; "
            f"at {BARS[0]:g} dB {cells[0]} vs {steps[2]}."
        )
    lines += ["", "At equal block compute (the pairs above), by PSNR against the full run:", ""]
    for sampler in dict.fromkeys(p.sampler for p in points):
        for kind, name in KINDS.items():
            mine = [(c, t) for c, t in pairs if c.sampler == sampler and c.kind == kind]
            if not mine:
                continue
            wins = [c for c, t in mine if c.psnr > t.psnr]
            detail = "; ".join(f"{c.label} {c.psnr - t.psnr:+.1f} dB vs {t.label}" for c, t in mine)
            lines.append(f"- **{sampler}, {name}**: closer than fewer steps in {len(wins)} of {len(mine)} ({detail}).")
    if model.unet:
        lines += _unet_quality(points, pairs)
    timed = [(c, t) for c, t in pairs if not math.isnan(c.ms_alone)]
    faster = sum(1 for c, t in timed if t.ms_alone <= c.ms_alone)
    timing = (
        f" Of the {len(timed)} timed pairs, fewer steps ran one image alone at least as fast in {faster} (medians "
        "of 3 on a shared CPU: noisy)."
        if timed
        else ""
    )
    if model.unet:
        lines += ["", _unet_wall(points, pairs, model) + timing]
    else:
        lines += [
            "",
            "- **Wall time.** A cache saves block evaluations only: the embedding, the final layer, the sampler step "
            f"and the engine's per-step work still run every step, and TeaCache adds its modulated input; fewer steps "
            f"save all of it.{timing}",
        ]
    if load is not None:
        lines.append(
            "- **Under load** each request keeps its own cache and decides per row, so its block fraction in a "
            "mixed batch is the one it has alone (the `blocks` column), and only computing rows run the deep "
            "blocks. What that saves depends on a forward's cost growing with its rows: on this CPU a DiT block "
            "over a few 16-token rows costs nearly what it costs over one, so the saving is smaller than the block "
            f"fraction. Here: {_load_summary(load)}."
        )
    if model.unet:
        lines.append(_unet_depth_note(points, model))
        return "\n".join(lines)
    lines.append(
        "- **The earlier trial.** A quick trial on a 6-layer toy under DDIM found that reusing the whole model "
        "output every N steps equals N× fewer steps. The caches here reuse a residual of the blocks instead: the "
        "embedding of the new latents and the final layer's timestep modulation are recomputed every step, which "
        "may be why TeaCache, the one that reuses the whole stack, still beats fewer steps here."
    )
    lines.append(_depth_note(model.blocks))
    return "\n".join(lines)


def _unet_quality(points: list, pairs: list[tuple]) -> list[str]:
    """Per sampler: the pairs judged as digits (FD and accuracy), not against the full run, and
    how far any setting moved FD and accuracy from the full run's."""
    lines = ["", "At equal block compute, by FD to the held-out digits and class accuracy:", ""]
    for sampler in dict.fromkeys(c.sampler for c, _ in pairs):
        mine = [(c, t) for c, t in pairs if c.sampler == sampler]
        lower = sum(1 for c, t in mine if c.fd < t.fd)
        accurate = sum(1 for c, t in mine if c.accuracy >= t.accuracy)
        detail = "; ".join(
            f"{c.label} FD {c.fd:.1f}, {c.accuracy:.0%} vs {t.label} FD {t.fd:.1f}, {t.accuracy:.0%}" for c, t in mine
        )
        every = [p for p in points if p.sampler == sampler]
        full = next(p for p in every if p.kind == "none")
        fds = [p.fd for p in every]
        low, high = (f"{f(p.accuracy for p in every):.0%}" for f in (min, max))
        lines.append(
            f"- **{sampler}**: the cache's FD is lower in {lower} of {len(mine)} pairs, its accuracy at least as "
            f"high in {accurate} of {len(mine)} ({detail}). Every setting of {sampler} lies within FD "
            f"{min(fds):.1f}–{max(fds):.1f}, accuracy {low if low == high else f'{low}–{high}'} (the full run: FD "
            f"{full.fd:.1f}, {full.accuracy:.0%})."
        )
    return lines


def _unet_wall(points: list, pairs: list[tuple], model: ModelText) -> str:
    """What the block fraction buys in wall time, batched, and cache against fewer steps."""
    parts = []
    for sampler in dict.fromkeys(p.sampler for p in points):
        full = next(p for p in points if p.sampler == sampler and p.kind == "none")
        caches = [p for p in points if p.sampler == sampler and p.kind == "interval"]
        ratios = (f"{p.label} {p.fraction:.2f} → {p.ms_per_image / full.ms_per_image:.2f}" for p in caches)
        parts.append(f"{sampler}: " + ", ".join(ratios))
    quicker = sum(1 for c, t in pairs if t.ms_per_image <= c.ms_per_image)
    return (
        "- **Wall time.** DeepCache saves the deep branch only: the time and class embedding, conv_in, the shallow "
        f"path (at the full {model.side}×{model.side}; the deep branch works below it), the sampler step and the "
        "engine's per-step work still run every step; fewer steps save all of it. Block fraction → batched time per "
        f"image, both against the full run's: {'; '.join(parts)}. Fewer steps were at least as fast "
        f"batched in {quicker} of {len(pairs)} pairs (one run each on a shared CPU: noisy)."
    )


def _unet_depth_note(points: list, model: ModelText) -> str:
    """The fraction no interval goes below: the computed warm-up and cool-down steps, and the shallow path."""
    floors = []
    for sampler in dict.fromkeys(p.sampler for p in points):
        steps = next(p.steps for p in points if p.sampler == sampler and p.kind == "none")
        full = WARMUP_STEPS + COOLDOWN_STEPS
        floor = (full * model.blocks + (steps - full) * model.shallow_blocks) / (steps * model.blocks)
        floors.append(f"{floor:.2f} at {sampler} {steps} steps")
    return (
        f"- **The U-Net is shallow.** A reusing row still runs {model.shallow_blocks} of the {model.blocks} blocks "
        f"(the shallow path: {model.shallow_share:.0%} of the parameters), so with the computed warm-up and "
        f"cool-down steps no interval brings the block fraction below {' and '.join(floors)} (interval → ∞). The "
        "block fraction counts blocks, not their cost, which differs from block to block (the wall time above "
        "says what a cached step costs)."
    )


def _depth_note(blocks: int) -> str:
    floor = "TeaCache skips the whole stack and alone escapes that floor"
    rescale = (
        " TeaCache here uses the raw relative L1 of the modulated input (no fitted rescaling polynomial, which "
        "the paper fits per model)."
    )
    if blocks <= 4:
        return (
            f"- **The model is shallow.** With {blocks} blocks, interval and First-Block-Cache always pay block 0, "
            f"1/{blocks} of the stack (their fraction cannot go below ~0.3 with the computed warm-up and cool-down "
            f"steps), whereas on FLUX (57 blocks) the first block is under 2%; {floor}. diffusion-cache-deep.md "
            "runs the same sweeps on a 12-block variant, where block 0 is a twelfth." + rescale
        )
    return (
        f"- **A deeper stack.** With {blocks} blocks, block 0 (what interval and First-Block-Cache always pay) is "
        f"1/{blocks} of the stack instead of the embedded model's quarter, so their block fraction can fall "
        "further; compare this report's equal-compute pairs with diffusion-cache.md's (4 blocks)." + rescale
    )


def _load_summary(load: list[tuple]) -> str:
    parts = []
    for rate in dict.fromkeys(row[0] for row in load):
        mine = {row[1]: row for row in load if row[0] == rate}
        base = mine.get("none")
        if base is None:
            continue
        for policy, row in mine.items():
            if policy != "none":
                parts.append(
                    f"{rate} {policy}: p50 {row[4] / base[4] - 1:+.0%}, p99 {row[5] / base[5] - 1:+.0%}, "
                    f"images/s {row[2] / base[2] - 1:+.0%}"
                )
    low, high = (float(x) for x in load[0][3].split("–"))
    return "; ".join(parts) + (
        f" against no cache (the uncached bursts ranged {low:g}–{high:g} images/s from round to round). Expect the "
        "gain where a forward has many rows (the burst) and little where it has few (the Poisson cells), whose "
        "latencies also move more from run to run on this shared CPU"
    )


def key_line(points: list, name: str = "diffusion-cache") -> str:
    sampler, bar = points[0].sampler, 35.0
    mine = [p for p in points if p.sampler == sampler]
    full = [p for p in mine if p.kind == "none"]
    parts = []
    for kind in kinds_of(mine):
        fraction, mark = fraction_at([p for p in mine if p.kind == kind] + full, bar)
        parts.append(f"{kind} {mark}{1 / fraction:.2f}×")
    return f"{name}: block speed-up at PSNR {bar:g} dB ({sampler} {full[0].steps} steps): " + ", ".join(parts)


def _fidelity_figure(points: list, samplers: list[str]):
    figure, axes = new_figure(len(samplers))
    for axis, sampler in zip(axes, samplers):
        for kind in (*KINDS, "steps"):
            mine = sorted((p for p in points if p.sampler == sampler and p.kind == kind), key=lambda p: p.fraction)
            if mine:
                label = KINDS.get(kind, "fewer steps")
                axis.plot([p.fraction for p in mine], [p.psnr for p in mine], STYLE[kind], label=label)
        axis.set(xlabel="block evaluations / full run", ylabel="PSNR vs full uncached run (dB)", title=sampler)
        axis.legend()
    return figure


def _wall_figure(points: list):
    figure, (axis,) = new_figure(1)
    sampler = points[0].sampler
    for kind in (*KINDS, "steps"):
        mine = sorted((p for p in points if p.sampler == sampler and p.kind == kind), key=lambda p: p.ms_alone)
        if mine:
            label = KINDS.get(kind, "fewer steps")
            axis.plot([p.ms_alone for p in mine], [p.psnr for p in mine], STYLE[kind], label=label)
    axis.set(xlabel="ms for one image alone (median)", ylabel="PSNR vs full uncached run (dB)", title=sampler)
    axis.legend()
    return figure


def _batched_figure(points: list, samplers: list[str]):
    figure, axes = new_figure(len(samplers))
    for axis, sampler in zip(axes, samplers):
        for kind in kinds_of(points):
            mine = sorted((p for p in points if p.sampler == sampler and p.kind == kind), key=lambda p: p.ms_per_image)
            if mine:
                label = KINDS.get(kind, "fewer steps")
                axis.plot([p.ms_per_image for p in mine], [p.psnr for p in mine], STYLE[kind], label=label)
        axis.set(xlabel="ms per image, batched", ylabel="PSNR vs full uncached run (dB)", title=sampler)
        axis.legend()
    return figure


def _fd_figure(points: list, samplers: list[str]):
    figure, axes = new_figure(len(samplers))
    for axis, sampler in zip(axes, samplers):
        full = [p for p in points if p.sampler == sampler and p.kind == "none"]
        for kind in kinds_of(points):
            mine = (
                sorted((p for p in points if p.sampler == sampler and p.kind == kind), key=lambda p: p.fraction) + full
            )
            if len(mine) > len(full):
                label = KINDS.get(kind, "fewer steps")
                axis.plot([p.fraction for p in mine], [p.fd for p in mine], STYLE[kind], label=label)
        axis.set(xlabel="block evaluations / full run", ylabel="FD to the held-out digits", title=sampler)
        axis.legend()
    return figure


def _load_figure(load: list[tuple]):
    figure, (axis,) = new_figure(1, width=11)
    labels = [f"{policy}\n{rate}" for rate, policy, *_ in load]
    x = range(len(load))
    axis.bar([i - 0.2 for i in x], [row[4] for row in load], 0.4, label="p50")
    axis.bar([i + 0.2 for i in x], [row[5] for row in load], 0.4, label="p99")
    axis.set_xticks(list(x), labels, fontsize=8)
    axis.set(ylabel="latency (ms)", title="one image, dpmsolver++ 25 steps, guidance 2")
    axis.legend()
    return figure

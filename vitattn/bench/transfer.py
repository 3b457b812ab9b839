"""Suite ``transfer``: peak memory of an attention-distillation training step, CPU float32.

Three variants of one training step (forward, cross-entropy (+ attention loss), backward; no
optimizer) on ViT-S/16 (``vit_small_patch16_224``) pairs:

- ``student only``: the student alone, task loss only: the floor every variant stands on;
- ``naive (maps kept)``: :class:`~vitattn.transfer.AttentionDistill` with ``recompute=False``: each
  distilled layer's loss is plain autograd on the dense maps (for ``loss="ce"`` ``softmax(T)`` and
  ``log_softmax(S)``, for ``loss="fy"`` the student normalizer's map and the formula's) kept until
  backward;
- ``vitattn (recompute)``: the default, O(N·d) per layer kept, maps rebuilt in backward by chunks.

Two losses: ``ce`` (softmax teacher and student, the paper's cross-entropy) and ``fy`` (the
Fenchel–Young loss of an entmax-1.5 student, ``vitattn.patch(student, "entmax15")``, against the
softmax teacher's probabilities; the student-only floor is then the entmax student's own step).

Each variant runs in a fresh subprocess (so nothing one leaves behind counts for the next), after one
warm-up step that allocates the gradients. Two honest measures of the step:

- ``peak MiB``: the largest number of bytes that torch's CPU allocator had handed out at once for
  allocations made during the step (read from the profiler's allocation events, which carry the
  allocator's running total); parameters, gradients and the teacher, allocated before, are not in it;
- ``RSS MiB``: the rise of the process's peak resident set (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``, minus ``VmRSS`` before the step), with glibc's mmap threshold fixed at
  64 KiB so that freed tensors go back to the OS; Linux only, else reported as 0.

``overhead`` is a variant's peak minus the student-only peak: what the distillation adds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .harness import Measurement, SuiteResult, machine_line, register_suite, timed_rounds

MODEL = "vit_small_patch16_224"
STUDENT = "student only"
NAIVE = "naive (maps kept)"
OURS = "vitattn (recompute)"
VARIANTS = (STUDENT, NAIVE, OURS)
CASES = [(224, 8), (448, 2)]  # (image size, batch); quick runs the first only
LOSSES = ("ce", "fy")
GOALS = {"ce": 0.5, "fy": 0.3}  # distillation overhead of ours / naive


@dataclass
class MemoryResult(SuiteResult):
    """Memory rows: ``extra`` holds ``peak_mib``, ``rss_mib`` and ``overhead_mib`` per variant."""

    def render(self) -> str:
        head = (
            f"{'case':<20}  {'implementation':<20}  {'peak MiB':>9}  {'× naive':>7}  {'overhead MiB':>12}  "
            f"{'× naive':>7}  {'RSS MiB':>8}  {'step ms':>8}"
        )
        lines = [self.title, machine_line(), head, "-" * len(head)]
        last = None
        for r in self.rows:
            naive = next(n for n in self.rows if n.case == r.case and n.impl == NAIVE).extra
            e = r.extra
            over = f"{e['overhead_mib']:>12.1f}" if r.impl != STUDENT else f"{'-':>12}"
            over_ratio = (
                f"{e['overhead_mib'] / naive['overhead_mib']:>6.2f}×" if r.impl != STUDENT else f"{'-':>7}"
            )
            lines.append(
                f"{(r.case if r.case != last else ''):<20}  {r.impl:<20}  {e['peak_mib']:>9.1f}  "
                f"{e['peak_mib'] / naive['peak_mib']:>6.2f}×  {over}  {over_ratio}  {e['rss_mib']:>8.1f}  "
                f"{r.ms:>8.0f}"
            )
            last = r.case
        lines.extend(self.notes)
        return "\n".join(lines)


# ---- the child process: one variant, one case -------------------------------------------------------
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _profiled_peak(step: Callable[[], object]) -> int:
    """Peak bytes live at once among the CPU allocations made during ``step()`` (profiler events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            peak = max(peak, int(event.extra_fields.total_allocated))
        stack.extend(event.children)
    return peak


def measure(variant: str, size: int, batch: int, repeat: int, loss: str = "ce") -> dict[str, float]:
    """Build the variant, warm up, then measure the RSS rise, the step time and the allocator peak."""
    import timm
    import torch.nn.functional as F

    from ..patch import patch
    from ..transfer import AttentionDistill
    from ..transfer.loss import resolve_loss

    torch.manual_seed(0)
    student = timm.create_model(MODEL, img_size=size)
    if loss == "fy":
        patch(student, "entmax15")
    if variant == STUDENT:
        model = student
    else:
        teacher = timm.create_model(MODEL, img_size=size)
        model = AttentionDistill(teacher, student, loss=resolve_loss(loss), recompute=variant == OURS)
    model.train()
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 1000, (batch,))

    def step() -> None:
        out = model(x)
        if variant == STUDENT:
            loss = F.cross_entropy(out, y)
        else:
            loss = F.cross_entropy(out.logits, y) + out.attn_loss
        loss.backward()

    step()  # warm-up: allocates the gradients
    model.zero_grad(set_to_none=False)
    rss = 0.0
    if sys.platform.startswith("linux"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _rss_kib("VmRSS")
        step()
        rss = (_rss_kib("VmHWM") - before) / 1024
    (timed,) = timed_rounds(variant, {variant: step}, rounds=repeat, min_run_time=0.0, warmup=0)
    peak = _profiled_peak(step) / 2**20
    return {"peak_mib": peak, "rss_mib": rss, "ms": timed.ms, "ms_min": timed.ms_min}


def _run_child(variant: str, size: int, batch: int, repeat: int, loss: str) -> dict[str, float]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(torch.get_num_threads()))
    code = "from vitattn.bench.transfer import _main; _main()"
    cmd = [sys.executable, "-c", code, "--child", variant, str(size), str(batch), str(repeat), loss]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"memory child for {variant!r} at {size}px failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@register_suite(
    "transfer",
    "attention distillation step, peak memory: vitattn recompute vs naive maps kept, cross-entropy and "
    "Fenchel-Young losses (ViT-S/16, CPU float32)",
)
def transfer_suite(quick: bool = False) -> MemoryResult:
    rows: list[Measurement] = []
    goals: dict[str, float] = {}
    for loss in LOSSES:
        for size, batch in CASES[:1] if quick else CASES:
            case = f"vit_s {size}px b{batch} {loss}"
            goals[case] = GOALS[loss]
            got = {v: _run_child(v, size, batch, 1 if quick else 3, loss) for v in VARIANTS}
            for v in VARIANTS:
                child = got[v]
                extra = {"peak_mib": child["peak_mib"], "rss_mib": child["rss_mib"]}
                extra["overhead_mib"] = child["peak_mib"] - got[STUDENT]["peak_mib"]
                rows.append(Measurement(case, v, child["ms"], child["ms_min"], 1 if quick else 3, extra))
    result = MemoryResult(
        name="transfer",
        title=(
            f"Attention distillation training step ({MODEL} teacher and student, default layers = all but "
            "the last 6, float32, CPU; ce: softmax student, fy: entmax-1.5 student): peak memory allocated "
            "during the step"
        ),
        reference=NAIVE,
        rows=rows,
    )
    for case in dict.fromkeys(r.case for r in rows):
        by = {r.impl: r.extra for r in rows if r.case == case}
        over = by[OURS]["overhead_mib"] / by[NAIVE]["overhead_mib"]
        whole = by[OURS]["peak_mib"] / by[NAIVE]["peak_mib"]
        for r in rows:
            if r.case == case and r.impl != STUDENT:
                r.extra["overhead_vs_naive"] = r.extra["overhead_mib"] / by[NAIVE]["overhead_mib"]
        result.notes.append(
            f"{case}: distillation overhead vitattn / naive = {over:.2f}x (goal <= {goals[case]}: "
            f"{'met' if over <= goals[case] else 'MISSED'}); whole step {whole:.2f}x (floor: the student's "
            f"own step, {by[STUDENT]['peak_mib']:.0f} MiB)"
        )
    return result


def _main() -> None:
    parser = argparse.ArgumentParser(description="one measurement of the transfer memory suite (internal)")
    parser.add_argument(
        "--child", nargs=5, metavar=("VARIANT", "SIZE", "BATCH", "REPEAT", "LOSS"), required=True
    )
    variant, size, batch, repeat, loss = parser.parse_args().child
    print(json.dumps(measure(variant, int(size), int(batch), int(repeat), loss)))


if __name__ == "__main__":
    _main()

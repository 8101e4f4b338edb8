"""kmix.report.finding_rules: advice that follows the recorded events and kmix's scale rule,
the audit's findings, and how a healthy run's notes are introduced (issue 21, items 4, 12)."""

from __future__ import annotations

import dataclasses

from test_report import event_line, hand_log

from kmix import report, tags
from kmix.tags import PolicyRecord

RECORD = PolicyRecord(
    "mixed_float16", "m", "mixed_float16", "float16", "float32", "kmix", 1.0, 2.0**24, 10, 0
)


def skip_log(lines, steps=40):
    """A log of ``steps`` steps whose skipped steps are the events of ``lines``."""
    skipped = sum(tags.parse_event(line).kind in tags.SKIP_KINDS for _, line in lines)
    return hand_log(
        scalars={tags.SKIPPED_STEPS: ([steps], [skipped]), tags.LOSS_SCALE: ([steps], [8.0])},
        texts={tags.EVENTS: lines},
    )


def skip_finding(log) -> str:
    (finding,) = [f for f in report.summarize(log).findings if f.rule == "skip_rate"]
    assert finding.severity == "warning"
    return finding.message


def test_hysteresis_is_never_advised_to_skip_fewer():
    """Under kmix's rule a hysteresis of 3 skipped 29 steps where 1 skipped 10."""
    lines = []
    for step in range(5, 35, 3):  # absorbed, absorbed, backoff: hysteresis 3
        lines.append(event_line(step, "skip_absorbed", 8.0, 8.0, "w"))
    lines.append(event_line(35, "backoff", 8.0, 4.0, "w"))
    message = skip_finding(skip_log(lines))
    assert message.startswith("28% of steps were skipped (11 of 40): those batches taught")
    assert "higher hysteresis skips fewer" not in message
    assert "10 were skipped at a scale the hysteresis kept" in message
    assert "a higher hysteresis skips no fewer; hysteresis=1 backs off at the first" in message
    assert "initial_scale" not in message  # no backoff at the start
    assert "By kind: 1 gradient overflow backed the scale off" in message


def test_forward_overflows_get_no_loss_scale_advice():
    lines = [event_line(s, "forward_overflow", 8.0, 8.0, None, False) for s in range(3, 13)]
    message = skip_finding(skip_log(lines))
    assert "initial_scale" not in message and "hysteresis=1" not in message
    assert "By kind: 10 forward overflows (the loss itself non-finite): no loss scale or " in (
        message
    )
    assert "only a change to the forward pass" in message


def test_backoffs_from_step_1_advise_the_scale_where_they_ended():
    lines = [event_line(s, "backoff", 2.0 ** (25 - s), 2.0 ** (24 - s), "w") for s in (1, 2, 3)]
    lines.append(event_line(20, "growth", 2.0**21, 2.0**22))
    lines.append(event_line(21, "backoff", 2.0**22, 2.0**21, "w"))
    lines.append(event_line(30, "overflow_at_floor", 1.0, 1.0, "w"))
    message = skip_finding(skip_log(lines))
    assert (
        "By kind: 3 backoffs in a row from step 1 lowered the initial scale 16777216 (2^24) "
        "to 2097152 (2^21): initial_scale=2097152 starts where they ended"
    ) in message
    assert "1 was the first overflow after a growth: a larger dynamic_growth_steps" in message
    assert "1 overflow at min_scale: no loss scale prevents those" in message
    assert "hysteresis" not in message and "other gradient" not in message


def test_skips_without_events_are_not_explained():
    log = hand_log(scalars={tags.SKIPPED_STEPS: ([40], [8]), tags.LOSS_SCALE: ([40], [8.0])})
    message = skip_finding(log)
    assert "Which kind of overflow they were is not recorded" in message
    assert "hysteresis" not in message and "initial_scale" not in message
    assert "stock Keras" not in message
    stock = dataclasses.replace(RECORD, loss_scaling="keras", min_scale=None, max_scale=None)
    log.texts[tags.POLICY_RECORD] = [(0, tags.format_policy_record(stock))]
    assert "kmix.LossScaleOptimizer records each skipped step and why" in skip_finding(log)


def test_the_audit_recorded_at_begin_is_in_the_report():
    audit = (
        tags.AuditFinding("warning", "", "the model's output is float16", "dtype='float32'"),
        tags.AuditFinding("warning", "head", "softmax computes in float16", "dtype='float32'"),
        tags.AuditFinding("info", "conv", "not a multiple of 8", "pad"),
    )
    record = dataclasses.replace(RECORD, audit_findings=audit)
    log = hand_log(
        scalars={tags.LOSS_SCALE: ([10], [8.0])},
        texts={tags.POLICY_RECORD: [(0, tags.format_policy_record(record))]},
    )
    summary = report.summarize(log)
    found = [(f.severity, f.rule, f.message) for f in summary.findings]
    assert found == [
        (
            "warning",
            "audit",
            "the audit of the model at train begin found (warning): the model's output is "
            "float16; fix: dtype='float32'",
        ),
        (
            "warning",
            "audit",
            "the audit of the model at train begin found (warning): `head`: softmax computes "
            "in float16; fix: dtype='float32'",
        ),
        (
            "info",
            "audit",
            "the audit of the model at train begin found (info): `conv`: not a multiple of 8; "
            "fix: pad",
        ),
    ]
    assert "no problems found" not in report.format_summary(summary)


def test_no_problems_found_ends_without_a_dangling_colon():
    one = hand_log(scalars={tags.LOSS_SCALE: ([10], [8.0])}, texts={tags.NOTES: [(0, "a note")]})
    first = report.summarize(one).findings[0]
    assert first.message == "no problems found; 1 note for information follows"
    alone = report.summarize(hand_log(scalars={tags.LOSS_SCALE: ([10], [8.0])}))
    assert [f.message for f in alone.findings] == ["no problems found"]
    for summary in (report.summarize(one), alone):
        assert not report.format_summary(summary).rstrip().endswith(":")


def test_a_bfloat16_run_says_each_note_once():
    """The monitor's note why float16 statistics are absent, written at two train begins."""
    note = "The model computes in bfloat16, not float16: float16's range does not apply."
    bf16 = dataclasses.replace(RECORD, model_policy="mixed_bfloat16", compute_dtype="bfloat16")
    log = hand_log(
        scalars={tags.LOSS_SCALE: ([192], [8.0]), tags.GRAD_NORM: ([100], [1.0])},
        texts={
            tags.NOTES: [(0, note), (192, note)],
            tags.POLICY_RECORD: [(0, tags.format_policy_record(bf16))],
        },
    )
    summary = report.summarize(log)
    notes = [f.message for f in summary.findings if f.rule == "note"]
    assert notes == [f"note at step 0, 192: {note}"]
    printed = report.format_summary(summary)
    assert printed.count(note) == 1
    assert f"  not logged because: {note}" in printed
    assert "  - note at step 0, 192: quoted above under 'not logged because'" in printed
    assert "no problems found; 2 notes for information follow" in printed  # both listed

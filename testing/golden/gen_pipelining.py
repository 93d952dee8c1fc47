"""Golden pipeline-schedule corpus from real PyTorch: torch/distributed/pipelining/schedules.py.

Run with the peer venv's python (`./x golden` does). Writes

  pipelining/testdata/golden_schedules.txt     read by pipelining/schedule_ir_test.cc

Every schedule class is built over mock stages (the attributes the schedules read: index,
stage count, group size and rank; no module, no process group), as PyTorch's own
test/distributed/pipelining/test_schedule.py does. The compute-only order and its lowering
to communication actions are recorded apart: the multi-stage schedules are built with
_PipelineScheduleRuntime._prepare_schedule_with_comms held back, which is then run on the
schedule's pipeline_order; GPipe's and 1F1B's order is _get_pipeline_order() before its
_add_reduce_grad (which drops the idle steps and adds the gradient reductions; the whole
_get_pipeline_order() is recorded too), lowered by a _PipelineScheduleRuntime over one mock
stage. Regenerating reproduces the file byte for byte.
"""

import contextlib
import csv
import io
import os
import tempfile

import golden_common as gc
import torch
from torch.distributed.pipelining import schedules as S

GOLDEN = "pipelining/testdata/golden_schedules.txt"

SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
SINGLE = ("GPipe", "1F1B")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
RANKS = (1, 2, 3, 4)

DOC = f"""
PyTorch {torch.__version__}'s pipeline schedules (torch/distributed/pipelining/schedules.py;
testing/golden/gen_pipelining.py). Fields tab-separated. An action list is one field, the
actions' repr comma-separated (`0F1`, `1UNSHARD`, `(0F3;1B2)OVERLAP_F_B`), `-` for an idle
step (None); an empty list is an empty field.
  case <name> <schedule> <ranks> <stages_per_rank> <n_microbatches> <max_active_stages>
       <defer_reduce_grad_wait 0|1> <defer_pp_recv 0|1>
                                a schedule built over mock stages with these lowering options
  compute <rank> <actions>      the compute-only order of the rank (pipeline_order; GPipe and
                                1F1B: _get_pipeline_order() before its _add_reduce_grad)
  pipeline_order <rank> <actions>   GPipe and 1F1B: the whole _get_pipeline_order()
  lowered <rank> <actions>      _prepare_schedule_with_comms(format="compute_only"):
                                pipeline_order_with_comms of the rank
  error <phase> <type> <message>    the schedule raised (phase `compute`: building the order,
                                `lower`: lowering it); message squeezed to one line, 120 chars
  format <name> <error_step|->  _format_pipeline_order(compute order of case <name>), its
                                lines following as `fline <line>|` (the `|` ends the line)
  csv <name> <text>             PipelineScheduleMulti._dump_csv of case <name>'s compute order,
                                the file text with `\\r`, `\\n`, `\\\\` escaped
  custom <name> <max_active_stages> <defer_reduce_grad_wait> <defer_pp_recv> <n_microbatches>
         <num_stages> <csv text>    _PipelineScheduleRuntime._load_csv of the (escaped) text,
                                its compute and lowered records following
  parse <text> <repr|error <type> <message>>   _Action.from_str(text) (`None` for None)
"""


class MockStage:
    """What the schedule constructors read of a _PipelineStageBase."""

    def __init__(self, stage_index, num_stages, group_size, group_rank):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank = {}


def actions_field(actions):
    return ",".join("-" if a is None else str(a) for a in actions)


def escape(text):
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")


def error_fields(phase, exc):
    return ["error", phase, type(exc).__name__, gc.one_line(exc)]


@contextlib.contextmanager
def lowering_held_back():
    """The schedule constructors without their final _prepare_schedule_with_comms call."""
    original = S._PipelineScheduleRuntime._prepare_schedule_with_comms
    S._PipelineScheduleRuntime._prepare_schedule_with_comms = lambda self, actions, format="compute_only": None
    try:
        yield original
    finally:
        S._PipelineScheduleRuntime._prepare_schedule_with_comms = original


@contextlib.contextmanager
def reduce_grad_held_back():
    """_get_pipeline_order() of GPipe / 1F1B without its final _add_reduce_grad."""
    original = S._add_reduce_grad
    S._add_reduce_grad = lambda actions, n_microbatches, defer_reduce_grad_wait=False: actions
    try:
        yield
    finally:
        S._add_reduce_grad = original


def lowering_options(opts):
    return {
        "max_active_stages": opts[0],
        "defer_reduce_grad_wait": bool(opts[1]),
        "defer_pp_recv": bool(opts[2]),
    }


def runtime(ranks, num_stages, n, opts):
    """A bare _PipelineScheduleRuntime over one mock stage, as a custom schedule is built."""
    return S._PipelineScheduleRuntime([MockStage(0, num_stages, ranks, 0)], n, **lowering_options(opts))


def build(name, ranks, spr, n, opts):
    """(compute order, whole _get_pipeline_order() or None, lowering function)."""
    cls = S.get_schedule_class(name)
    num_stages = ranks * spr
    if name in SINGLE:
        sched = cls(MockStage(0, num_stages, ranks, 0), n)
        with reduce_grad_held_back():
            compute = sched._get_pipeline_order()
        whole = sched._get_pipeline_order()

        def lower():
            rt = runtime(ranks, num_stages, n, opts)
            rt._prepare_schedule_with_comms(compute)
            return rt.pipeline_order_with_comms

        return compute, whole, lower
    if name in V_SHAPED:
        stage_ids = [0, num_stages - 1]
    else:
        stage_ids = [ranks * k for k in range(spr)]
    stages = [MockStage(i, num_stages, ranks, 0) for i in stage_ids]
    with lowering_held_back() as prepare:
        sched = cls(stages, n, **lowering_options(opts))
    compute = sched.pipeline_order

    def lower():
        prepare(sched, {r: list(v) for r, v in compute.items()})
        return sched.pipeline_order_with_comms

    return compute, None, lower


def order_records(golden, kind, order):
    for rank in sorted(order):
        golden.add("\t".join([kind, str(rank), actions_field(order[rank])]))


def run_case(golden, name, ranks, spr, n, opts=(3, 0, 0)):
    case = f"{name}_r{ranks}_s{spr}_n{n}"
    if opts != (3, 0, 0):
        case += f"_m{opts[0]}" + ("_dw" if opts[1] else "") + ("_dr" if opts[2] else "")
    golden.add("\t".join(["case", case, name, str(ranks), str(spr), str(n)] + [str(int(o)) for o in opts]))
    golden.records += 1
    try:
        compute, whole, lower = build(name, ranks, spr, n, opts)
    except Exception as e:  # noqa: BLE001 -- PyTorch's rejection is the record
        golden.add("\t".join(error_fields("compute", e)))
        return case, None
    order_records(golden, "compute", compute)
    if whole is not None:
        order_records(golden, "pipeline_order", whole)
    try:
        lowered = lower()
    except Exception as e:  # noqa: BLE001
        golden.add("\t".join(error_fields("lower", e)))
        return case, compute
    order_records(golden, "lowered", lowered)
    return case, compute


def microbatch_counts(ranks, spr):
    top = 2 * ranks * spr + 1
    if ranks * spr <= 6:
        return list(range(1, top + 1))
    # Larger pipelines: around the stage count, and the two ends.
    return sorted({1, 2, ranks, ranks * spr - 1, ranks * spr, ranks * spr + 1, ranks * spr + 2, top - 1, top})


def stages_per_rank(name):
    if name in SINGLE:
        return (1,)
    if name in V_SHAPED:
        return (2,)
    return (1, 2, 3)


# Lowering options on a few cases: (schedule, ranks, spr, n, (max_active_stages,
# defer_reduce_grad_wait, defer_pp_recv)).
OPTION_CASES = (
    ("GPipe", 2, 1, 3, (3, 0, 1)),
    ("1F1B", 1, 1, 2, (3, 1, 0)),
    ("Interleaved1F1B", 2, 2, 4, (3, 0, 1)),
    ("Interleaved1F1B", 2, 2, 4, (3, 1, 0)),
    ("Interleaved1F1B", 2, 3, 4, (1, 1, 1)),
    ("Interleaved1F1B", 4, 3, 8, (2, 0, 1)),
    ("LoopedBFS", 3, 2, 3, (2, 1, 1)),
    ("LoopedBFS", 2, 3, 5, (1, 0, 0)),
    ("InterleavedZeroBubble", 2, 2, 4, (3, 1, 1)),
    ("InterleavedZeroBubble", 3, 2, 6, (1, 0, 1)),
    ("ZBVZeroBubble", 2, 2, 4, (3, 1, 1)),
    ("ZBVZeroBubble", 3, 2, 5, (1, 0, 1)),
    ("DualPipeV", 2, 2, 6, (3, 1, 1)),
    ("DualPipeV", 2, 2, 5, (3, 0, 1)),
    ("DualPipeV", 2, 2, 4, (1, 0, 0)),
    ("DualPipeV", 3, 2, 8, (2, 1, 0)),
)

# _format_pipeline_order of these cases' compute order (error_step None or a step).
FORMAT_CASES = (
    ("GPipe_r2_s1_n2", None),
    ("1F1B_r3_s1_n4", 2),
    ("Interleaved1F1B_r2_s2_n4", 3),
    ("LoopedBFS_r4_s3_n13", None),
    ("InterleavedZeroBubble_r3_s2_n6", 10),
    ("ZBVZeroBubble_r2_s2_n2", 0),
    ("DualPipeV_r2_s2_n5", None),
    ("DualPipeV_r4_s2_n9", 17),
)

CSV_CASES = ("Interleaved1F1B_r2_s2_n4", "ZBVZeroBubble_r2_s2_n3", "DualPipeV_r2_s2_n4", "GPipe_r3_s1_n2")

# Hand-written compute-only schedules, as a user's CSV file: (name, lowering options, n, stages, text).
CUSTOM_CASES = (
    (
        "two_ranks_looped",
        (3, 0, 0),
        2,
        4,
        "0F0,0F1,2F0,,2F1,2B0,2B1,0B0,,0B1\r\n,1F0,1F1,3F0,3B0,3F1,3B1,1B0,1B1\r\n",
    ),
    (
        "two_ranks_v_split_backward",
        (2, 1, 1),
        2,
        4,
        "0F0,0F1,3F0,3I0,3W0,3F1,3I1,0I0,3W1,0W0,0I1,0W1\n1F0,2F0,1F1,2F1,2I0,2W0,2I1,1I0,2W1,1I1,1W0,1W1\n",
    ),
    (
        "one_rank_overlap",
        (3, 0, 0),
        2,
        2,
        '0F0,1F0,0F1,"(1F1;1B0)OVERLAP_F_B",1B1,0B0,0B1\r\n',
    ),
    (
        "two_ranks_not_compute_only",
        (3, 0, 0),
        1,
        2,
        "0F0,0SEND_F0,0B0\r\n1RECV_F0,1F0,1B0\r\n",
    ),
)

PARSE_CASES = (
    "0F0",
    "12B34",
    "3W",
    "  2I7  ",
    "1UNSHARD",
    "1RESHARD",
    "0SEND_F3",
    "1RECV_F3",
    "2SEND_B0",
    "1RECV_B0",
    "0WAIT_SEND_F1",
    "0WAIT_SEND_B1",
    "4REDUCE_GRAD",
    "4WAIT_REDUCE_GRAD",
    "(0F3;1B2)OVERLAP_F_B",
    "( 0F3 ; 1B2 )OVERLAP_F_B",
    "(0F3;;1B2)OVERLAP_F_B",
    "()OVERLAP_F_B",
    "(0F3)F",
    "(0F3;1B2)BOGUS",
    "(0F3;X)OVERLAP_F_B",
    "0F1garbage",
    "0FF",
    "0WAIT",
    "",
    "   ",
    "F0",
    "X",
    "-1F0",
    "0OVERLAP_F_B",
    "0f0",
    "(0F3",
)


def parse_record(text):
    try:
        a = S._Action.from_str(text)
        result = ["None" if a is None else repr(a)]
    except Exception as e:  # noqa: BLE001
        result = ["error", type(e).__name__, gc.one_line(e)]
    return "\t".join(["parse", text] + result)


def main():
    gc.quiet_torch()
    golden = gc.GoldenFile(GOLDEN, DOC)
    computed = {}
    for name in SCHEDULES:
        for ranks in RANKS:
            for spr in stages_per_rank(name):
                for n in microbatch_counts(ranks, spr):
                    case, compute = run_case(golden, name, ranks, spr, n)
                    computed[case] = compute
    for name, ranks, spr, n, opts in OPTION_CASES:
        run_case(golden, name, ranks, spr, n, opts)

    for case, step in FORMAT_CASES:
        text = S._format_pipeline_order(computed[case], error_step_number=step)
        golden.add("\t".join(["format", case, "-" if step is None else str(step)]))
        for line in text.split("\n")[:-1]:
            golden.add("fline\t" + line + "|")
        golden.records += 1

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "schedule.csv")
        for case in CSV_CASES:
            sched = S._PipelineScheduleRuntime.__new__(S._PipelineScheduleRuntime)
            sched.pipeline_order = computed[case]
            S.PipelineScheduleMulti._dump_csv(sched, path)
            with open(path, newline="") as f:
                golden.add("\t".join(["csv", case, escape(f.read())]))
            golden.records += 1

        for name, opts, n, num_stages, text in CUSTOM_CASES:
            with open(path, "w", newline="") as f:
                f.write(text)
            ranks = len(list(csv.reader(io.StringIO(text, newline=""))))
            golden.add("\t".join(["custom", name] + [str(int(o)) for o in opts] + [str(n), str(num_stages), escape(text)]))
            golden.records += 1
            rt = runtime(ranks, num_stages, n, opts)
            try:
                rt._load_csv(path)
            except Exception as e:  # noqa: BLE001
                if rt.pipeline_order:
                    order_records(golden, "compute", rt.pipeline_order)
                golden.add("\t".join(error_fields("lower", e)))
                continue
            order_records(golden, "compute", rt.pipeline_order)
            order_records(golden, "lowered", rt.pipeline_order_with_comms)

    for text in PARSE_CASES:
        golden.add(parse_record(text))
        golden.records += 1
    golden.write()


if __name__ == "__main__":
    main()

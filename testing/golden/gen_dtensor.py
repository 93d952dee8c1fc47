"""Golden DTensor corpus from real PyTorch: per-rank layouts and redistributes.

Run with the peer venv's python (`./x golden` does): CPU only, all ranks simulated in this
process by LocalTensorMode (torch/distributed/_local_tensor/__init__.py) over PyTorch's fake
process group, so the collectives are PyTorch's own code paths. Writes

  dtensor/testdata/golden_layouts.txt       read by dtensor/golden_layout_test.cc
  dtensor/testdata/golden_redistribute.txt  read by dtensor/golden_redistribute_test.cc

The formats are documented at the top of each file (LAYOUT_DOC, REDISTRIBUTE_DOC below)
and follow testing/golden/golden_common.py's conventions. Cases are hand-picked edge cases
plus a fixed random sample; regenerating reproduces the files byte for byte.

`--verify-gloo` replays the suspicious redistributes and a sample of the others on real
ranks (one process each, Gloo) to show that the corpus records PyTorch, not an artifact of
the simulation (with torch 2.15.0: identical, apart from the documented differences).
"""

import argparse
import itertools
import math
import random
import time
import traceback

import golden_common as gc
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import _redistribute
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

LAYOUT_DOC = """
Per-rank layouts of torch.distributed.tensor placements (testing/golden/gen_dtensor.py).
A case is one `layout` line followed by one `at` line per mesh coordinate (row-major):
  layout <mesh_shape> <global_shape> <placement per mesh dim>...
  at <coordinate> <local_shape> <global_offset> <local values>
local_shape and global_offset: torch/distributed/tensor/_utils.py
_compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)
(a _StridedShard block that is not contiguous reports its first global index).
Local values: the global tensor is torch.arange(numel).view(global_shape); the local
tensor is distribute_tensor(global, mesh, placements, src_data_rank=None)'s on that rank
(each placement's _split_tensor left to right over the mesh dims), Partial taken as
Replicate (Partial is a statement about values, not layout); flattened row-major.
"""

REDISTRIBUTE_DOC = """
DTensor.redistribute on every rank (testing/golden/gen_dtensor.py), float64 data.
A case:
  redistribute <mesh_shape> <global_shape> <src placement>... -> <dst placement>...
  in <rank> <local_shape> <values>          one per rank, ascending
then either PyTorch's refusal (raised on purpose by torch/distributed/tensor code)
  error <exception type> <start of the message>
or PyTorch failing its own internal checks (on some ranks only; real ranks hang or abort)
  fails <exception type> <start of the message>
or its result
  steps <mesh_dim>:<from>-><to> ...         the transform steps PyTorch ran, in order
                                            (torch/distributed/tensor/_redistribute.py;
                                            `-` when none)
  comms <kind>=<count> ...                  the collectives issued, counted by
                                            CommDebugMode, kinds sorted (`-` when none):
                                            all_gather, all_reduce, all_to_all,
                                            reduce_scatter, broadcast
  out <rank> <local_shape> <values>         one per rank, ascending
  split <rank> <local_shape> <values>       only where `out` is not PyTorch's own layout of
                                            the result (its placements' _split_tensor of the
                                            value below under dst): that layout, per rank;
                                            values `?` where a Partial in dst leaves them open
Input rule (what `in` holds): global = torch.arange(numel, dtype=float64).view(shape);
each rank's local = its block of global under src with every Partial taken as Replicate
(distribute_tensor with src_data_rank=None), times the product over the Partial mesh dims
m of (coordinate[m] + 1). The DTensor is DTensor.from_local(local, mesh, src, shape=...).
The redistributed value is arange times, per Partial source mesh dim of n ranks,
n(n+1)/2 (sum) or (n+1)/2 (avg). Rank r's mesh coordinate is r unravelled row-major over
mesh_shape. Ranks are simulated by LocalTensorMode, which runs the accelerator code path
(Shard(i) -> Shard(j) is an all_to_all; PyTorch on CPU Gloo all-gathers instead); cases
the simulation itself cannot run are left out.
"""

# Fixed so that regenerating gives the same sample (the files are compared byte for byte).
SAMPLING_KEY = 20150


def S(d):
    return Shard(d)


def SS(d, sf):
    return _StridedShard(d, split_factor=sf)


R = Replicate()
PSUM = Partial("sum")
PAVG = Partial("avg")


def coordinate_of(rank, mesh_shape):
    coord = []
    for size in reversed(mesh_shape):
        coord.append(rank % size)
        rank //= size
    return list(reversed(coord))


def key(mesh_shape, shape, *placement_lists):
    tokens = tuple(tuple(gc.placement_token(p) for p in pl) for pl in placement_lists)
    return (tuple(mesh_shape), tuple(shape)) + tokens


# ---------------------------------------------------------------- sampling


def placement_options(ndim, split_factors, partials):
    """Every placement of one mesh dim for a tensor of `ndim` dims."""
    opts = [S(d) for d in range(ndim)]
    opts += [SS(d, sf) for d in range(ndim) for sf in split_factors]
    return opts + [R] + list(partials)


def weighted_placement(rng, ndim, split_factors, partials, weights):
    """One random placement; weights = (shard, strided, replicate, each partial)."""
    kinds = [("S", weights[0]), ("SS", weights[1]), ("R", weights[2])]
    kinds += [(p, weights[3]) for p in partials]
    r = rng.random() * sum(w for _, w in kinds)
    for kind, w in kinds:
        r -= w
        if r < 0:
            break
    if kind == "S":
        return S(rng.randrange(ndim))
    if kind == "SS":
        return SS(rng.randrange(ndim), rng.choice(split_factors))
    return R if kind == "R" else kind


def random_shape(rng, sizes, max_numel, max_ndim=3):
    while True:
        shape = tuple(rng.choice(sizes) for _ in range(rng.randint(1, max_ndim)))
        if math.prod(shape) <= max_numel:
            return shape


# ---------------------------------------------------------------- layouts


def layout_cases():
    """(mesh shape, global shape, placements), hand-picked first, without duplicates."""
    cases = []
    # Hand-picked: the examples in PyTorch's own docstrings and comments
    # (placement_types.py _StridedShard / _to_replicate_tensor, _utils.py), empty shards,
    # fewer rows than ranks, and 0-sized dims.
    cases += [
        ([4], (9,), [SS(0, 2)]),
        ([2, 2], (8, 8), [SS(0, 2), S(0)]),
        ([2, 2], (8,), [S(0), SS(0, 2)]),
        ([2, 2], (2, 5), [S(1), S(1)]),
        ([4], (5, 3), [S(0)]),
        ([4], (6,), [S(0)]),
        ([8], (3, 2), [S(0)]),
        ([2, 2], (5, 7), [S(0), S(0)]),
        ([2, 3], (5, 7), [S(0), S(1)]),
        ([2, 4], (9, 5), [SS(0, 3), R]),
        ([2, 2, 2], (0, 3), [S(0), S(1), S(0)]),
        ([2, 2, 2], (7, 5, 3), [SS(0, 2), S(0), S(2)]),
        ([2, 2, 2], (12, 2), [SS(0, 4), SS(0, 2), S(0)]),
        ([3, 2], (4,), [S(0), SS(0, 3)]),
    ]
    # Every placement of 1-D meshes over a fixed set of shapes.
    shapes_1d_mesh = [(0,), (1,), (3,), (5,), (7,), (8,), (12,), (17,), (20,)]
    shapes_1d_mesh += [(5, 3), (0, 4), (7, 2), (3, 9), (2, 3, 4)]
    for n in [1, 2, 3, 4, 8]:
        for shape in shapes_1d_mesh:
            for p in placement_options(len(shape), [2, 3, 4], [PSUM]):
                cases.append(([n], shape, [p]))
    # A fixed random sample on 2-D and 3-D meshes (all tensor dims, split factors 2..4).
    rng = random.Random(SAMPLING_KEY)
    sizes = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16, 20]
    plan = [
        ([[2, 2], [2, 3], [3, 2], [4, 2], [2, 4], [1, 4], [4, 1], [1, 1]], 1000, 64),
        ([[2, 2, 2], [2, 1, 2], [1, 2, 2], [2, 2, 1], [1, 2, 3], [2, 1, 3]], 800, 48),
    ]
    for meshes, count, max_numel in plan:
        for i in range(count):
            mesh = meshes[i % len(meshes)]
            shape = random_shape(rng, sizes, max_numel)
            pl = [weighted_placement(rng, len(shape), [2, 3, 4], [PSUM], (4, 2.5, 1.5, 0.5)) for _ in mesh]
            cases.append((mesh, shape, pl))
    seen, unique = set(), []
    for c in cases:
        k = key(*c)
        if k not in seen:
            seen.add(k)
            unique.append(c)
    return unique


def mesh_for(meshes, mesh_shape):
    """One DeviceMesh per shape and world: creating one makes process groups."""
    if tuple(mesh_shape) not in meshes:
        meshes[tuple(mesh_shape)] = init_device_mesh("cpu", tuple(mesh_shape))
    return meshes[tuple(mesh_shape)]


def local_block(global_t, mesh_shape, coord, placements):
    """The block of `global_t` the rank at `coord` holds, as distribute_tensor(...,
    src_data_rank=None) computes it (torch/distributed/tensor/_api.py): each shard-like
    placement's own _split_tensor (torch/distributed/tensor/placement_types.py), left to
    right over the mesh dims, keeping piece coord[m]; Replicate and Partial keep all."""
    t = global_t
    for m, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            t = p._split_tensor(t, mesh_shape[m], with_padding=False, contiguous=True)[0][coord[m]]
    return t


def check_against_distribute_tensor(cases):
    """local_block must equal what distribute_tensor itself produces on every rank; checked
    for a subset (every eighth case, LocalTensorMode is slow). LocalTensorMode cannot run
    some uneven _StridedShard splits (it pads a rank's shorter torch.chunk result with
    rank 0's empty-shard shape); such cases are skipped here, not in the corpus."""
    by_world = {}
    for c in cases[::8]:
        by_world.setdefault(math.prod(c[0]), []).append(c)
    checked = 0
    for world in sorted(by_world):
        with gc.simulated_world(world):
            meshes = {}
            for mesh_shape, shape, pl in by_world[world]:
                mesh = mesh_for(meshes, mesh_shape)
                global_t = torch.arange(math.prod(shape)).view(shape)
                layout_pl = [R if p.is_partial() else p for p in pl]
                try:
                    local = distribute_tensor(global_t, mesh, layout_pl, src_data_rank=None).to_local()
                except RuntimeError:
                    continue
                with mode_disabled():
                    for rank in range(world):
                        expected = local_block(global_t, mesh_shape, coordinate_of(rank, mesh_shape), layout_pl)
                        if not torch.equal(gc.rank_tensor(local, rank), expected):
                            raise AssertionError(f"local_block != distribute_tensor for {pl} {shape} rank {rank}")
                checked += 1
    print(f"  {checked} layout cases checked against distribute_tensor")


def mode_disabled():
    from torch.distributed._local_tensor import local_tensor_mode

    return local_tensor_mode().disable()


def write_layouts():
    out = gc.GoldenFile("dtensor/testdata/golden_layouts.txt", LAYOUT_DOC)
    cases = layout_cases()
    for mesh_shape, shape, pl in cases:
        global_t = torch.arange(math.prod(shape)).view(shape)
        out.add("layout %s %s %s" % (gc.ints(mesh_shape), gc.ints(shape), " ".join(map(gc.placement_token, pl))))
        for rank in range(math.prod(mesh_shape)):
            coord = coordinate_of(rank, mesh_shape)
            lshape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, pl)
            data = local_block(global_t, mesh_shape, coord, pl)
            if tuple(data.shape) != tuple(lshape):
                raise AssertionError(f"PyTorch disagrees with itself on {pl} {shape} at {coord}")
            out.add("at %s %s %s %s" % (gc.ints(coord), gc.ints(lshape), gc.ints(offset), gc.values(data)))
        out.records += 1
    out.write()
    check_against_distribute_tensor(cases)


# ---------------------------------------------------------------- redistribute


def redistribute_cases():
    """(mesh shape, global shape, src, dst), hand-picked first, without duplicates."""
    cases = []
    # The examples on 2x2x2 (PyTorch: 3, 3 and 2 collectives), then other
    # hand-picked ones: nested shards, uneven shards, Shard -> Partial(sum), the refusals.
    s3 = (5, 6, 7)
    cases += [
        ([2, 2, 2], s3, [S(0), S(0), S(0)], [S(1), S(1), S(1)]),
        ([2, 2, 2], s3, [S(0), S(1), S(0)], [S(1), S(0), S(0)]),
        ([2, 2, 2], s3, [S(0), S(1), S(2)], [S(2), S(1), S(0)]),
        ([2, 2, 2], (4, 4, 2), [S(0), S(0), S(0)], [R, R, R]),
        ([2, 2, 2], (3, 2), [PSUM, PAVG, S(0)], [R, R, R]),
        ([2, 2, 2], (3, 2), [PSUM, PSUM, PSUM], [S(0), S(1), R]),
        ([2, 2], (5, 3), [S(0), S(0)], [R, S(0)]),
        ([2, 2], (5, 3), [R, S(0)], [S(0), S(0)]),
        ([2, 2], (8, 2), [SS(0, 2), S(0)], [R, R]),
        ([2, 2], (8, 2), [R, R], [SS(0, 2), S(0)]),
        ([4], (9,), [SS(0, 2)], [R]),
        ([4], (5, 3), [S(0)], [PSUM]),
        ([4], (5, 3), [R], [PSUM]),
        ([4], (5, 3), [PSUM], [PAVG]),
        ([4], (5, 3), [PAVG], [S(1)]),
        ([3], (2, 2), [S(0)], [S(1)]),
        ([2], (0, 3), [S(0)], [S(1)]),
        ([2, 2], (5, 3), [S(0), R], [S(0), R]),
    ]
    # Every pair of placements on 1-D meshes for a few shapes.
    for n in [1, 2, 3, 4, 8]:
        for shape in [(7,), (5, 3)]:
            opts = placement_options(len(shape), [2, 3], [PSUM, PAVG])
            for a, b in itertools.product(opts, opts):
                cases.append(([n], shape, [a], [b]))
    # A fixed random sample on 2-D and 3-D meshes, mostly uneven shapes.
    rng = random.Random(SAMPLING_KEY + 1)
    sizes = [0, 1, 2, 3, 4, 5, 6, 7]
    plan = [
        ([[2, 2], [2, 3], [3, 2], [4, 2], [2, 4], [1, 4], [4, 1], [2, 1]], 750, 48),
        ([[2, 2, 2], [2, 1, 2], [1, 2, 2], [2, 2, 1], [1, 2, 3]], 650, 36),
    ]
    for meshes, count, max_numel in plan:
        for i in range(count):
            mesh = meshes[i % len(meshes)]
            shape = random_shape(rng, sizes, max_numel)
            parts = [PSUM, PAVG]
            src = [weighted_placement(rng, len(shape), [2, 3], parts, (4, 1.5, 2, 0.75)) for _ in mesh]
            dst = [weighted_placement(rng, len(shape), [2, 3], parts, (4, 1.5, 2.5, 0.25)) for _ in mesh]
            if rng.random() < 0.15:  # some dims unchanged: nested shards stay in place
                m = rng.randrange(len(mesh))
                dst[m] = src[m]
            cases.append((mesh, shape, src, dst))
    seen, unique = set(), []
    for c in cases:
        k = key(*c)
        if k not in seen:
            seen.add(k)
            unique.append(c)
    return unique


class StepRecorder:
    """Records the transform steps redistribute_local_tensor runs: it passes them through
    _optimize_transform_infos (torch/distributed/tensor/_redistribute.py), so wrapping
    that module function sees exactly the executed list."""

    def __init__(self):
        self.steps = None
        self._inner = _redistribute._optimize_transform_infos
        _redistribute._optimize_transform_infos = self._record

    def _record(self, infos, *args, **kwargs):
        result = self._inner(infos, *args, **kwargs)
        self.steps = list(result)
        return result

    def text(self):
        if not self.steps:
            return "-"
        return " ".join(
            "%d:%s->%s" % (t.mesh_dim, *map(gc.placement_token, t.src_dst_placements)) for t in self.steps
        )


def source_locals(mesh_shape, shape, src):
    """Every rank's input by the documented rule (REDISTRIBUTE_DOC), cut outside
    LocalTensorMode: it is much faster there, and the mode cannot run every uneven
    _StridedShard split itself."""
    global_t = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    partial_dims = [m for m, p in enumerate(src) if p.is_partial()]
    locals_ = []
    for rank in range(math.prod(mesh_shape)):
        coord = coordinate_of(rank, mesh_shape)
        factor = math.prod(coord[m] + 1 for m in partial_dims)
        locals_.append((local_block(global_t, mesh_shape, coord, src) * factor).contiguous())
    return locals_


def fresh_caches():
    """Forgets PyTorch's redistribute plans (the @cache on _gen_transform_infos and the
    planner cache in torch/distributed/tensor/_redistribute.py), so that every case runs as
    the first redistribute of a fresh process, whatever cases ran before it (the caches
    are keyed by specs and meshes that compare equal across cases)."""
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def classify_failure(exc):
    """`error` (a refusal: raised on purpose by DTensor's own code, e.g. "Can not
    redistribute from R to P(sum)" in torch/distributed/tensor/_api.py), `simulated`
    (LocalTensorMode itself cannot run the case: per-rank Python values differ; the case
    is left out) or `fails` (a check inside PyTorch's collectives or ops trips, e.g. a
    torch._check in Shard._maybe_unpad_tensor)."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1].filename.replace("\\", "/") if frames else ""
    if "/torch/distributed/_local_tensor/" in last:
        return "simulated"
    if "/torch/distributed/tensor/" in last and not isinstance(exc, AssertionError):
        return "error"
    return "fails"


def run_redistributes(world, cases, inputs):
    """Runs `cases` (all on `world` ranks) under LocalTensorMode; one outcome per case:
    ("ok", steps, comms, per-rank outputs) or (kind, exception type, message)."""
    comm_debug_mode = gc.import_comm_debug_mode()
    recorder = StepRecorder()
    outcomes = []
    with gc.simulated_world(world) as mode:
        meshes = {}
        for (mesh_shape, shape, src, dst), locals_ in zip(cases, inputs):
            mesh = mesh_for(meshes, mesh_shape)
            global_t = torch.empty(shape, dtype=torch.float64)
            local = mode.rank_map(lambda r: locals_[r])
            d = DTensor.from_local(local, mesh, src, shape=global_t.shape, stride=global_t.stride())
            recorder.steps = None
            fresh_caches()
            try:
                with comm_debug_mode() as cm:
                    local = d.redistribute(mesh, dst).to_local()
                outs = [gc.rank_tensor(local, r).clone() for r in range(world)]
                outcomes.append(("ok", recorder.text(), gc.comm_counts(cm), outs))
            except Exception as e:  # PyTorch's refusals are part of the corpus
                outcomes.append((classify_failure(e), type(e).__name__, gc.one_line(e)))
    return outcomes


def own_layout(mesh_shape, shape, src, dst):
    """PyTorch's own layout of the redistributed value under dst (local_block, i.e. its
    placements' _split_tensor), per rank. The value is the reduction of the input rule:
    arange times, per Partial source dim of n ranks, n(n+1)/2 (sum) or (n+1)/2 (avg). A
    Partial in dst leaves the values open: then only the shapes (_utils.py
    _compute_local_shape_and_global_offset), as empty tensors of that shape and NaN."""
    if any(p.is_partial() for p in dst):
        world = math.prod(mesh_shape)
        coords = [coordinate_of(r, mesh_shape) for r in range(world)]
        shapes = [_compute_local_shape_and_global_offset(shape, mesh_shape, c, dst)[0] for c in coords]
        return [torch.full(s, float("nan"), dtype=torch.float64) for s in shapes]
    scale = 1.0
    for m, p in enumerate(src):
        if p.is_partial():
            n = mesh_shape[m]
            scale *= n * (n + 1) / 2 if p.reduce_op == "sum" else (n + 1) / 2
    value = torch.arange(math.prod(shape), dtype=torch.float64).view(shape) * scale
    return [local_block(value, mesh_shape, coordinate_of(r, mesh_shape), dst) for r in range(math.prod(mesh_shape))]


def on_layout(outs, split):
    """Whether every rank's output is its part of own_layout (shape only where NaN)."""
    return all(a.shape == b.shape and (b.isnan().all() or torch.equal(a, b)) for a, b in zip(outs, split))


def write_redistribute():
    out = gc.GoldenFile("dtensor/testdata/golden_redistribute.txt", REDISTRIBUTE_DOC)
    cases = redistribute_cases()
    inputs = [source_locals(c[0], c[1], c[2]) for c in cases]
    by_world = {}
    for i, c in enumerate(cases):
        by_world.setdefault(math.prod(c[0]), []).append(i)
    outcomes = {}
    for world in sorted(by_world):
        idx = by_world[world]
        for i, o in zip(idx, run_redistributes(world, [cases[i] for i in idx], [inputs[i] for i in idx])):
            outcomes[i] = o
    tally, suspicious = {}, []
    for i, (mesh_shape, shape, src, dst) in enumerate(cases):
        o = outcomes[i]
        kind = o[0]
        if kind == "ok":
            split = own_layout(mesh_shape, shape, src, dst)
            if not on_layout(o[3], split):
                kind = "ok, off its own layout"
            else:
                split = None
        tally[kind] = tally.get(kind, 0) + 1
        if kind != "ok":
            suspicious.append(i)
        if kind == "simulated":
            continue
        src_text, dst_text = (" ".join(map(gc.placement_token, pl)) for pl in (src, dst))
        out.add("redistribute %s %s %s -> %s" % (gc.ints(mesh_shape), gc.ints(shape), src_text, dst_text))
        for rank, t in enumerate(inputs[i]):
            out.add("in %d %s %s" % (rank, gc.ints(t.shape), gc.values(t)))
        if o[0] == "ok":
            out.add("steps " + o[1])
            out.add("comms " + o[2])
            for rank, t in enumerate(o[3]):
                out.add("out %d %s %s" % (rank, gc.ints(t.shape), gc.values(t)))
            for rank, t in enumerate(split or []):
                data = "?" if t.numel() and t.isnan().all() else gc.values(t)
                out.add("split %d %s %s" % (rank, gc.ints(t.shape), data))
        else:
            out.add("%s %s %s" % o)
        out.records += 1
    out.write()
    print("  outcomes: " + ", ".join(f"{k} {tally[k]}" for k in sorted(tally)) + " (simulated: left out)")
    return cases, inputs, outcomes, suspicious


def _gloo_rank(rank, world, port, jobs, result_dir):
    """One real rank (a process, Gloo over 127.0.0.1) of verify_with_gloo; writes each
    case's outcome to its own file at once, so that a hang loses only that case."""
    import datetime

    import torch.distributed as dist

    gc.quiet_torch()
    address, timeout = f"tcp://127.0.0.1:{port}", datetime.timedelta(seconds=20)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world, timeout=timeout)
    comm_debug_mode = gc.import_comm_debug_mode()
    # Ranks that disagree on a case (one raises before a collective the others wait in)
    # meet again here after the others time out; their mesh groups are then replaced.
    control = dist.new_group(list(range(world)))
    meshes = {}
    for index, mesh_shape, shape, src, dst, local in jobs:
        mesh = mesh_for(meshes, mesh_shape)
        global_t = torch.empty(shape, dtype=torch.float64)
        d = DTensor.from_local(local[rank], mesh, src, shape=global_t.shape, stride=global_t.stride())
        fresh_caches()
        try:
            with comm_debug_mode() as cm:
                out = d.redistribute(mesh, dst).to_local()
            result = ("ok", gc.comm_counts(cm), out.clone())
        except Exception as e:
            result = (classify_failure(e), type(e).__name__, gc.one_line(e))
        torch.save(result, gc.result_path(result_dir, index, rank))
        kinds = [None] * world
        dist.all_gather_object(kinds, result[0], group=control)
        if len(set(kinds)) > 1:
            meshes.clear()
    dist.destroy_process_group()


def cpu_counts(comms):
    """Collective counts with all-to-all counted as the all-gather the CPU runs instead."""
    counts = {}
    for item in comms.split():
        if item != "-":
            kind, n = item.split("=")
            kind = "all_gather" if kind == "all_to_all" else kind
            counts[kind] = counts.get(kind, 0) + int(n)
    return counts


def verify_with_gloo(cases, inputs, outcomes, suspicious):
    """Replays cases on real ranks (one process each, Gloo) and compares with the
    LocalTensorMode outcomes, so that the corpus records PyTorch, not the simulation: the
    suspicious cases (PyTorch failing, off its own layout, not simulable) and every 16th
    other one, leaving out Partial(avg) (Gloo has no AVG). On the CPU PyTorch replaces the
    all-to-all of Shard(i) -> Shard(j) by an all-gather (shard_dim_alltoall in
    torch/distributed/tensor/_collective_utils.py); that difference is expected. Slow on 2
    cores (many minutes); `gen_dtensor.py --verify-gloo`."""
    import tempfile

    chosen = sorted(set(suspicious) | set(range(0, len(cases), 16)))
    by_world = {}
    for i in chosen:
        if not any(p.is_partial() and p.reduce_op == "avg" for p in cases[i][2] + cases[i][3]):
            by_world.setdefault(math.prod(cases[i][0]), []).append(i)
    tally = {}
    for world in sorted(by_world):
        idx = by_world[world]
        with tempfile.TemporaryDirectory() as result_dir:
            gc.run_on_gloo(_gloo_rank, world, [(i, *cases[i], inputs[i]) for i in idx], result_dir)
            real_all = {i: [torch.load(gc.result_path(result_dir, i, r)) for r in range(world)] for i in idx}
        for i in idx:
            sim, real = outcomes.get(i), real_all[i]
            real_ok = all(o[0] == "ok" for o in real)
            real_own = real_ok and on_layout([o[2] for o in real], own_layout(*cases[i]))
            if sim[0] == "ok" and real_ok:
                same = all(cpu_counts(o[1]) == cpu_counts(sim[2]) for o in real)
                same = same and all(torch.equal(o[2], sim[3][r]) for r, o in enumerate(real))
            else:
                same = all(o[0] == sim[0] and o[1:] == sim[1:] for o in real)
            verdict = "same" if same else "differs"
            key_ = f"{'suspicious' if i in suspicious else 'sample'}: {verdict}, real on own layout {real_own}"
            tally[key_] = tally.get(key_, 0) + 1
            if not same:
                real_text = [o[:2] for o in real]
                print(f"  gloo differs: {cases[i]}: simulated {sim[:3]}, real {real_text}, on own layout {real_own}")
        print(f"  gloo: {len(idx)} cases on {world} ranks checked")
    for k in sorted(tally):
        print(f"  gloo verification: {tally[k]} x {k}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verify-gloo", action="store_true", help="also replay the redistributes on real Gloo ranks")
    args = parser.parse_args()
    gc.quiet_torch()
    start = time.time()
    write_layouts()
    result = write_redistribute()
    print(f"gen_dtensor.py: {time.time() - start:.1f} s with torch {torch.__version__}")
    if args.verify_gloo:
        verify_with_gloo(*result)


if __name__ == "__main__":
    main()

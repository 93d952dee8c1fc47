#include "pipelining/pipeline_schedule.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <utility>

#include "pipelining/microbatch.h"

namespace fsdp::pipelining {

// What one step() keeps between actions (PyTorch's fwd_recv_ops, bwd_recv_ops, the pending
// sends, backward_counter and _internal_losses), in tables by (this rank's stage, microbatch).
// Kept from step to step and cleared, so the tables and their work lists, the same size every
// step, are allocated once rather than an entry at a time.
struct PipelineSchedule::StepState {
  // The works of one posted batch of sends or receives, until waited for.
  struct Posted {
    std::vector<comm::WorkPtr> works;
    bool pending = false;
  };
  int n_microbatches = 0;
  std::vector<Posted> forward_recvs;               // [local stage * n_microbatches + mb]
  std::vector<Posted> backward_recvs;              // the same
  std::vector<Posted> forward_sends;               // the same
  std::vector<Posted> backward_sends;              // the same
  std::vector<int> backward_count;                 // [local stage]: B or W done
  std::vector<char> unshard_pending;               // [local stage]: UNSHARD issued and not yet waited for
  std::vector<char> finalized;                     // [local stage]: REDUCE_GRAD resharded it already
  std::vector<at::Tensor> losses;                  // [mb]: the last stage's loss
  bool backward = false;                           // step() with a loss_fn; not eval()
  std::vector<std::vector<at::Tensor>> kwarg_mbs;  // by microbatch; empty without kwargs
  bool compute_losses = false;                     // the last stage computes loss_fn per microbatch
  std::vector<comm::ProcessGroup::P2POp> ops;      // the batch being posted

  // The current action's start, for options.on_action.
  std::chrono::steady_clock::time_point action_start;

  // Drops what a step left (works, losses and their graphs), keeping the tables' memory, and
  // sizes the tables for `local_stages` stages and `n` microbatches.
  void Reset(size_t local_stages, int n) {
    n_microbatches = n;
    for (auto* table : {&forward_recvs, &backward_recvs, &forward_sends, &backward_sends}) {
      for (Posted& p : *table) {
        p.works.clear();
        p.pending = false;
      }
      table->resize(local_stages * n);
    }
    backward_count.assign(local_stages, 0);
    unshard_pending.assign(local_stages, 0);
    finalized.assign(local_stages, 0);
    losses.clear();
    kwarg_mbs.clear();
  }
  Posted& At(std::vector<Posted>& table, int local, int mb) {
    TORCH_CHECK(mb >= 0 && mb < n_microbatches, "microbatch ", mb, " outside [0, n_microbatches = ", n_microbatches,
                ")");
    return table[local * n_microbatches + mb];
  }

  // Issues `ops` into `posted`, whose work list keeps its memory from step to step.
  void Post(comm::ProcessGroup& group, Posted& posted) {
    group.batch_isend_irecv(ops, posted.works);
    posted.pending = true;
  }
};

namespace {

void WaitAll(std::vector<comm::WorkPtr>& works) {
  for (comm::WorkPtr& w : works) w->wait();
  works.clear();
}

// Metadata travels as int64: [count, (dtype, ndim, sizes...)...], after its length.
at::Tensor EncodeMeta(const std::vector<TensorMeta>& meta) {
  std::vector<int64_t> v{static_cast<int64_t>(meta.size())};
  for (const TensorMeta& m : meta) {
    v.push_back(static_cast<int64_t>(m.dtype));
    v.push_back(static_cast<int64_t>(m.sizes.size()));
    v.insert(v.end(), m.sizes.begin(), m.sizes.end());
  }
  return at::tensor(v, at::kLong);
}

std::vector<TensorMeta> DecodeMeta(const at::Tensor& t, int stage) {
  const int64_t* p = t.data_ptr<int64_t>();
  const int64_t n = t.numel();
  auto at_ = [&](int64_t i) {
    TORCH_CHECK(i < n, "stage ", stage, ": malformed activation metadata from the previous stage");
    return p[i];
  };
  std::vector<TensorMeta> out;
  int64_t i = 0;
  const int64_t count = at_(i++);
  for (int64_t k = 0; k < count; ++k) {
    TensorMeta m;
    m.dtype = static_cast<at::ScalarType>(at_(i++));
    const int64_t ndim = at_(i++);
    for (int64_t d = 0; d < ndim; ++d) m.sizes.push_back(at_(i++));
    out.push_back(std::move(m));
  }
  return out;
}

// The order Schedule1F1B._step_microbatches runs on each rank (torch/distributed/pipelining/
// schedules.py): min(n, ranks - rank) forwards, then a backward and a forward in turn until the
// forwards are done, then the remaining backwards. (Its _get_pipeline_order, ComputeOrder's
// k1F1B, only draws the schedule and is not runnable: the last rank's forwards start at
// microbatch 1.)
PipelineOrder OneFOneBRunOrder(int ranks, int n) {
  PipelineOrder order;
  for (int r = 0; r < ranks; ++r) {
    auto& row = order[r];
    const int warmup = std::min(n, ranks - r);
    int f = 0;
    int b = 0;
    while (f < warmup) row.push_back(Action{r, ActionType::kForward, f++, {}});
    while (b < n) {
      row.push_back(Action{r, ActionType::kFullBackward, b++, {}});
      if (f < n) row.push_back(Action{r, ActionType::kForward, f++, {}});
    }
  }
  return order;
}

PipelineOrder ComputeOnly(const PipelineOrder& order) {
  PipelineOrder out;
  for (const auto& [rank, actions] : order) {
    auto& row = out[rank];
    for (const std::optional<Action>& a : actions) {
      if (!a || a->IsCompute()) row.push_back(a);
    }
  }
  return out;
}

}  // namespace

PipelineSchedule::~PipelineSchedule() = default;
PipelineSchedule::PipelineSchedule(PipelineSchedule&&) noexcept = default;

PipelineSchedule::PipelineSchedule(ScheduleKind kind, std::vector<std::shared_ptr<PipelineStage>> stages,
                                   PipelineScheduleOptions options)
    : stages_(std::move(stages)), options_(std::move(options)) {
  TORCH_CHECK(!stages_.empty(), "PipelineSchedule: no stages given");
  TORCH_CHECK(stages_[0] != nullptr, "PipelineSchedule: stages[0] is null");
  const int ranks = stages_[0]->group()->size();
  const int per_rank = static_cast<int>(stages_.size());
  TORCH_CHECK(!IsSingleStageSchedule(kind) || per_rank == 1, "PipelineSchedule: ", ScheduleName(kind),
              " runs one stage per rank, got ", per_rank, " stages");
  TORCH_CHECK(stages_[0]->num_stages() == ranks * per_rank, "PipelineSchedule: ", ScheduleName(kind), " with ",
              per_rank, " stage(s) on each of ", ranks, " ranks needs num_stages = ", ranks * per_rank,
              ", the stages say ", stages_[0]->num_stages());
  stage_to_rank_ = [kind, ranks](int stage) { return StageRank(kind, stage, ranks); };
  TORCH_CHECK(options_.n_microbatches >= 1, "PipelineSchedule: n_microbatches must be at least 1, got ",
              options_.n_microbatches);
  Init(kind == ScheduleKind::k1F1B ? OneFOneBRunOrder(ranks, options_.n_microbatches)
                                   : ComputeOrder(kind, ranks, per_rank, options_.n_microbatches));
}

PipelineSchedule::PipelineSchedule(const PipelineOrder& compute_order, std::function<int(int)> stage_to_rank,
                                   std::vector<std::shared_ptr<PipelineStage>> stages, PipelineScheduleOptions options)
    : stages_(std::move(stages)), options_(std::move(options)), stage_to_rank_(std::move(stage_to_rank)) {
  TORCH_CHECK(!stages_.empty(), "PipelineSchedule: no stages given");
  TORCH_CHECK(static_cast<bool>(stage_to_rank_), "PipelineSchedule: stage_to_rank is empty");
  Init(compute_order);
}

void PipelineSchedule::Init(const PipelineOrder& compute_order) {
  TORCH_CHECK(options_.n_microbatches >= 1, "PipelineSchedule: n_microbatches must be at least 1, got ",
              options_.n_microbatches);
  const comm::ProcessGroupPtr& group = stages_[0]->group();
  num_stages_ = stages_[0]->num_stages();
  std::set<int> seen;
  for (size_t i = 0; i < stages_.size(); ++i) {
    const auto& s = stages_[i];
    TORCH_CHECK(s != nullptr, "PipelineSchedule: stages[", i, "] is null");
    TORCH_CHECK(s->group() == group, "PipelineSchedule: stages[", i, "] uses another process group than stages[0]");
    TORCH_CHECK(s->num_stages() == num_stages_, "PipelineSchedule: stages[", i, "] says num_stages = ", s->num_stages(),
                ", stages[0] says ", num_stages_);
    TORCH_CHECK(seen.insert(s->stage_index()).second, "PipelineSchedule: stage ", s->stage_index(), " given twice");
    const int owner = stage_to_rank_(s->stage_index());
    TORCH_CHECK(owner == group->rank(), "PipelineSchedule: stage ", s->stage_index(), " belongs on rank ", owner,
                " under this schedule's placement, not on rank ", group->rank());
  }
  local_index_.assign(num_stages_, -1);
  for (size_t i = 0; i < stages_.size(); ++i) {
    TORCH_CHECK(stages_[i]->stage_index() < num_stages_, "PipelineSchedule: stages[", i, "] has stage_index ",
                stages_[i]->stage_index(), ", outside [0, num_stages = ", num_stages_, ")");
    local_index_[stages_[i]->stage_index()] = static_cast<int>(i);
  }
  TORCH_CHECK(static_cast<int>(compute_order.size()) == group->size(), "PipelineSchedule: the order has ",
              compute_order.size(), " ranks, the group ", group->size());
  lowered_ = LowerWithComms(ComputeOnly(compute_order), options_.n_microbatches, stage_to_rank_, num_stages_,
                            options_.lowering);
  auto it = lowered_.find(group->rank());
  TORCH_CHECK(it != lowered_.end(), "PipelineSchedule: the order has no actions for rank ", group->rank());
  actions_ = it->second;
  input_with_weight_ = InputBackwardsFollowedByTheirWeight(actions_);
  for (const Action& a : actions_) {
    for (const Action& leaf : a.sub_actions.empty() ? std::vector<Action>{a} : a.sub_actions) {
      TORCH_CHECK(seen.count(leaf.stage) == 1, "PipelineSchedule: rank ", group->rank(), "'s action ", leaf.ToString(),
                  " names stage ", leaf.stage, ", which is not among its stages");
    }
  }
}

int PipelineSchedule::LocalIndex(int stage) const {
  return stage >= 0 && stage < static_cast<int>(local_index_.size()) ? local_index_[stage] : -1;
}

PipelineStage& PipelineSchedule::StageOf(const Action& action) {
  const int local = LocalIndex(action.stage);
  TORCH_CHECK(local >= 0, "action ", action.ToString(), " names stage ", action.stage, ", not on this rank");
  return *stages_[local];
}

void PipelineSchedule::InferMetaIfNeeded(const std::vector<std::vector<at::Tensor>>& arg_mbs,
                                         const std::vector<std::vector<at::Tensor>>& kwarg_mbs) {
  bool all = true;
  for (auto& s : stages_) all = all && s->has_meta();
  if (all) return;
  std::vector<std::shared_ptr<PipelineStage>> ordered = stages_;
  std::sort(ordered.begin(), ordered.end(),
            [](const auto& a, const auto& b) { return a->stage_index() < b->stage_index(); });
  const comm::ProcessGroupPtr& group = stages_[0]->group();
  const int meta_tag_base = 2 * num_stages_;
  std::vector<comm::WorkPtr> sends;
  std::vector<at::Tensor> in_flight;
  std::vector<TensorMeta> previous;
  int previous_stage = -2;
  for (auto& s : ordered) {
    std::vector<TensorMeta> inputs;
    if (s->is_first()) {
      TORCH_CHECK(!arg_mbs.empty(), "stage 0 needs the pipeline's arguments to infer its shapes");
    } else if (previous_stage == s->stage_index() - 1) {
      inputs = previous;
    } else {
      // The messages live on the stage's device, which its group moves (PyTorch's
      // recv_object_list(device=self.device)).
      const at::TensorOptions on_device = at::TensorOptions(at::kLong).device(s->device());
      at::Tensor length = at::empty({1}, on_device);
      const int src = stage_to_rank_(s->stage_index() - 1);
      group->recv(length, src, meta_tag_base + s->stage_index())->wait();
      const int64_t n = length.item<int64_t>();
      TORCH_CHECK(n >= 1, "stage ", s->stage_index(), ": bad metadata length ", n);
      at::Tensor payload = at::empty({n}, on_device);
      group->recv(payload, src, meta_tag_base + s->stage_index())->wait();
      inputs = DecodeMeta(payload.cpu(), s->stage_index());
    }
    previous = s->InferMeta(s->is_first() ? arg_mbs[0] : std::vector<at::Tensor>{}, inputs,
                            kwarg_mbs.empty() ? std::vector<at::Tensor>{} : kwarg_mbs[0]);
    previous_stage = s->stage_index();
    if (!s->is_last() && stage_to_rank_(s->stage_index() + 1) != group->rank()) {
      at::Tensor payload = EncodeMeta(previous).to(s->device());
      at::Tensor length = at::tensor(std::vector<int64_t>{payload.numel()}, at::kLong).to(s->device());
      const int dst = stage_to_rank_(s->stage_index() + 1);
      in_flight.push_back(length);
      in_flight.push_back(payload);
      sends.push_back(group->send(length, dst, meta_tag_base + s->stage_index() + 1));
      sends.push_back(group->send(payload, dst, meta_tag_base + s->stage_index() + 1));
    }
  }
  WaitAll(sends);
}

std::vector<at::Tensor> PipelineSchedule::step(const std::vector<at::Tensor>& args, const at::Tensor& target,
                                               std::vector<at::Tensor>* losses, const std::vector<at::Tensor>& kwargs) {
  return Run(args, target, losses, kwargs, /*backward=*/static_cast<bool>(options_.loss_fn));
}

std::vector<at::Tensor> PipelineSchedule::eval(const std::vector<at::Tensor>& args, const at::Tensor& target,
                                               std::vector<at::Tensor>* losses, const std::vector<at::Tensor>& kwargs) {
  return Run(args, target, losses, kwargs, /*backward=*/false);
}

std::vector<at::Tensor> PipelineSchedule::Run(const std::vector<at::Tensor>& args, const at::Tensor& target,
                                              std::vector<at::Tensor>* losses, const std::vector<at::Tensor>& kwargs,
                                              bool backward) {
  const int n = options_.n_microbatches;
  bool has_first = false;
  bool has_last = false;
  for (auto& s : stages_) {
    has_first = has_first || s->is_first();
    has_last = has_last || s->is_last();
  }
  std::vector<std::vector<at::Tensor>> arg_mbs;
  if (has_first) {
    TORCH_CHECK(!args.empty(), "step: this rank holds stage 0, which needs the batch's arguments (args is empty)");
    arg_mbs = SplitIntoMicrobatches(args, n);
  }
  std::vector<at::Tensor> target_mbs;
  // eval(): losses where a target is given (PyTorch's _maybe_compute_loss).
  const bool compute_losses = has_last && options_.loss_fn && (backward || target.defined());
  if (compute_losses) {
    TORCH_CHECK(target.defined(), "step: this rank holds the last stage and a loss_fn is set: target is undefined");
    target_mbs = SplitTensorIntoMicrobatches(target, n);
  }
  const std::vector<std::vector<at::Tensor>> kwarg_mbs =
      kwargs.empty() ? std::vector<std::vector<at::Tensor>>{} : SplitIntoMicrobatches(kwargs, n);
  for (auto& s : stages_) s->BeginStep(n, stage_to_rank_);
  InferMetaIfNeeded(arg_mbs, kwarg_mbs);
  if (state_ == nullptr) state_ = std::make_unique<StepState>();
  state_->Reset(stages_.size(), n);  // drops what a failed step left
  state_->kwarg_mbs = kwarg_mbs;
  state_->backward = backward;
  state_->compute_losses = compute_losses;
  state_->losses.resize(compute_losses ? n : 0);
  for (size_t i = 0; i < actions_.size(); ++i) {
    const Action& action = actions_[i];
    try {
      if (action.type == ActionType::kOverlapFB) {
        for (const Action& sub : action.sub_actions) TimedPerform(sub, arg_mbs, target_mbs);
      } else {
        TimedPerform(action, arg_mbs, target_mbs);
      }
    } catch (const c10::Error& e) {
      PipelineOrder order;
      for (const auto& [rank, list] : lowered_) {
        order[rank].assign(list.begin(), list.end());
      }
      TORCH_CHECK(false, "pipeline rank ", stages_[0]->group()->rank(), " failed at step ", i, ", action ",
                  action.ToString(), ": ", e.what_without_backtrace(), "\nThe schedule:\n",
                  FormatPipelineOrder(order, static_cast<int>(i)));
    }
  }
  for (const auto* sends : {&state_->forward_sends, &state_->backward_sends}) {
    for (size_t i = 0; i < sends->size(); ++i) {
      TORCH_CHECK(!(*sends)[i].pending, "pipeline: a send of stage ", stages_[i / n]->stage_index(), " microbatch ",
                  i % n, " was never waited for (the schedule lacks its WAIT_SEND)");
    }
  }
  std::vector<at::Tensor> merged;
  for (auto& s : stages_) {
    if (!s->is_last()) continue;
    merged = s->MergeOutputs();
    if (losses != nullptr && compute_losses) {
      const auto computed = std::count_if(state_->losses.begin(), state_->losses.end(),
                                          [](const at::Tensor& loss) { return loss.defined(); });
      TORCH_CHECK(computed == n, "expecting ", n, " losses but got ", computed);
      losses->clear();
      for (const at::Tensor& loss : state_->losses) losses->push_back(loss.detach());
    }
  }
  state_->Reset(stages_.size(), n);
  return merged;
}

void PipelineSchedule::TimedPerform(const Action& action, const std::vector<std::vector<at::Tensor>>& arg_mbs,
                                    const std::vector<at::Tensor>& target_mbs) {
  if (!options_.on_action) return Perform(action, arg_mbs, target_mbs);
  state_->action_start = std::chrono::steady_clock::now();
  Perform(action, arg_mbs, target_mbs);
  options_.on_action(action, state_->action_start, std::chrono::steady_clock::now());
}

void PipelineSchedule::Perform(const Action& action, const std::vector<std::vector<at::Tensor>>& arg_mbs,
                               const std::vector<at::Tensor>& target_mbs) {
  StepState& st = *state_;
  const bool backward = st.backward;
  PipelineStage& stage = StageOf(action);
  const int s = action.stage;
  const int local = LocalIndex(s);
  const int mb = action.microbatch.value_or(-1);
  const int next_local = LocalIndex(s + 1);
  const int prev_local = LocalIndex(s - 1);
  comm::ProcessGroup& group = *stage.group();
  const bool computes = action.type == ActionType::kForward || action.type == ActionType::kFullBackward ||
                        action.type == ActionType::kBackwardInput || action.type == ActionType::kBackwardWeight;
  if (computes && st.unshard_pending[local]) {
    st.unshard_pending[local] = 0;
    stage.data_parallel()->WaitUnshard();
  }
  auto restart_clock = [&] {
    if (options_.on_action) st.action_start = std::chrono::steady_clock::now();
  };
  if (computes) restart_clock();  // after the UNSHARD's wait
  const bool backward_compute = action.type == ActionType::kFullBackward || action.type == ActionType::kBackwardInput ||
                                action.type == ActionType::kBackwardWeight;
  if (backward && backward_compute && stage.data_parallel() != nullptr) stage.data_parallel()->BeforeBackward();
  // The receive of this action's microbatch in `table`, waited for.
  auto wait_received = [&](std::vector<StepState::Posted>& table, const char* what) {
    StepState::Posted& posted = st.At(table, local, mb);
    TORCH_CHECK(posted.pending, "computing ", action.ToString(), " before receiving its ", what);
    WaitAll(posted.works);
    posted.pending = false;
  };
  switch (action.type) {
    case ActionType::kSendF: {
      StepState::Posted& posted = st.At(st.forward_sends, local, mb);
      TORCH_CHECK(!posted.pending, "a second SEND_F of stage ", s, " microbatch ", mb, " before its wait");
      stage.ForwardSendOps(mb, st.ops);
      st.Post(group, posted);
      return;
    }
    case ActionType::kSendB: {
      if (!backward) return;
      StepState::Posted& posted = st.At(st.backward_sends, local, mb);
      TORCH_CHECK(!posted.pending, "a second SEND_B of stage ", s, " microbatch ", mb, " before its wait");
      stage.BackwardSendOps(mb, st.ops);
      st.Post(group, posted);
      return;
    }
    case ActionType::kWaitSendF:
    case ActionType::kWaitSendB: {
      const bool forward = action.type == ActionType::kWaitSendF;
      if (!forward && !backward) return;
      StepState::Posted& posted = st.At(forward ? st.forward_sends : st.backward_sends, local, mb);
      TORCH_CHECK(posted.pending, action.ToString(), " waits for a send that was never issued");
      WaitAll(posted.works);
      posted.pending = false;
      if (forward) stage.ReleaseForwardSend(mb);
      return;
    }
    case ActionType::kRecvF: {
      StepState::Posted& posted = st.At(st.forward_recvs, local, mb);
      TORCH_CHECK(!posted.pending, "RECV_F twice for stage ", s, " microbatch ", mb, " without its forward");
      stage.ForwardRecvOps(mb, st.ops);
      st.Post(group, posted);
      return;
    }
    case ActionType::kRecvB: {
      if (!backward) return;
      StepState::Posted& posted = st.At(st.backward_recvs, local, mb);
      TORCH_CHECK(!posted.pending, "RECV_B twice for stage ", s, " microbatch ", mb, " without its backward");
      stage.BackwardRecvOps(mb, st.ops);
      st.Post(group, posted);
      return;
    }
    case ActionType::kUnshard:
      if (stage.data_parallel() != nullptr) {
        stage.data_parallel()->Unshard();
        st.unshard_pending[local] = 1;
      }
      return;
    case ActionType::kReshard:
      if (stage.data_parallel() != nullptr && !st.finalized[local]) {
        if (st.unshard_pending[local]) {
          st.unshard_pending[local] = 0;
          stage.data_parallel()->WaitUnshard();
        }
        stage.data_parallel()->Reshard();
      }
      st.finalized[local] = 0;
      return;
    case ActionType::kWaitReduceGrad: return;  // REDUCE_GRAD is synchronous
    case ActionType::kForward: {
      if (!stage.is_first() && prev_local < 0) wait_received(st.forward_recvs, "input");
      restart_clock();
      const std::vector<at::Tensor>& out =
          stage.Forward(mb, stage.is_first() ? arg_mbs.at(mb) : std::vector<at::Tensor>{},
                        st.kwarg_mbs.empty() ? std::vector<at::Tensor>{} : st.kwarg_mbs.at(mb));
      if (stage.is_last() && st.compute_losses) st.losses.at(mb) = options_.loss_fn(out, target_mbs.at(mb));
      if (next_local >= 0) stages_[next_local]->SetLocalForwardInput(mb, out);
      return;
    }
    case ActionType::kFullBackward:
    case ActionType::kBackwardInput: {
      if (!backward) return;
      const bool full = action.type == ActionType::kFullBackward;
      if (!stage.is_last() && next_local < 0) wait_received(st.backward_recvs, "gradients");
      restart_clock();
      at::Tensor loss;
      if (stage.is_last()) {
        TORCH_CHECK(mb >= 0 && mb < static_cast<int>(st.losses.size()) && st.losses[mb].defined(),
                    "the loss of microbatch ", mb, " is not available");
        loss = st.losses[mb];
      }
      if (full) ++st.backward_count[local];
      using Part = PipelineStage::BackwardPart;
      stage.Backward(mb, loss,
                     full                                    ? Part::kFull
                     : input_with_weight_.count({s, mb}) > 0 ? Part::kInputWithWeight
                                                             : Part::kInput);
      if (prev_local >= 0) stages_[prev_local]->SetLocalBackwardInput(mb, stage.LocalBackwardOutput(mb));
      return;
    }
    case ActionType::kBackwardWeight:
      if (!backward) return;
      ++st.backward_count[local];
      stage.BackwardWeight(mb);
      return;
    case ActionType::kReduceGrad:
      if (!backward) return;
      TORCH_CHECK(st.backward_count[local] == options_.n_microbatches, "REDUCE_GRAD of stage ", s, " after ",
                  st.backward_count[local], " of its ", options_.n_microbatches, " backwards");
      if (stage.data_parallel() != nullptr) {
        stage.data_parallel()->ReduceGrad();
        st.finalized[local] = 1;
      }
      stage.ScaleGrads(options_.scale_grads ? options_.n_microbatches : 1);
      return;
    case ActionType::kOverlapFB:
      break;  // a container (stage -1, so StageOf has rejected it): step() performs its sub-actions
  }
  TORCH_CHECK(false, "unknown action ", action.ToString());
}

}  // namespace fsdp::pipelining

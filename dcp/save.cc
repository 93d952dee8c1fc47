// dcp::Save and dcp::AsyncSave (dcp.h): plan (torch/distributed/checkpoint/
// default_planner.py create_local_save_plan + _dedup_save_plans.py), write this rank's items
// (filesystem.py FileSystemWriter.write_data), gather the fragments and write `.metadata`
// on rank 0 (FileSystemWriter.finish), as torch/distributed/checkpoint/state_dict_saver.py
// save / async_save run them.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/dcp_storage.h"
#include "comm/object_collectives.h"
#include "comm/profiler_range.h"
#include "dcp/adapter.h"
#include "dcp/collectives.h"
#include "dcp/dcp.h"
#include "dcp/plan.h"
#include "dcp/stager.h"
#include "dcp/stager_access.h"
#include "dcp/state_items.h"

namespace fsdp::dcp {
namespace {

using checkpoint::DcpBytesItem;
using checkpoint::DcpFragment;
using checkpoint::DcpTensorItem;
using internal::Box;
using internal::PlannedItem;

constexpr char kAsyncSave[] = "dcp::AsyncSave";

// This rank's part of the checkpoint after de-duplication.
struct RankPlan {
  std::unique_ptr<internal::ModelAdapter> adapter;  // the sources' layouts point into it
  comm::ProcessGroupPtr world;
  internal::SaveSources sources;
  std::vector<std::pair<size_t, Box>> tensors;  // (source, box), in plan order
  std::vector<size_t> bytes;                    // sources.bytes indices
  int rank = 0;
  absl::flat_hash_map<std::string, std::vector<checkpoint::DcpPathElement>> paths;  // key -> object path
};

struct RankItems {
  std::vector<DcpTensorItem> tensors;
  std::vector<DcpBytesItem> bytes;
  bool empty() const { return tensors.empty() && bytes.empty(); }
};

std::string MetadataPath(const std::string& dir) {
  return !dir.empty() && dir.back() == '/' ? dir + ".metadata" : dir + "/.metadata";
}

std::string DataFilePath(const std::string& dir, int rank) {
  const std::string name = checkpoint::DcpDataFileName(rank);
  return !dir.empty() && dir.back() == '/' ? dir + name : absl::StrCat(dir, "/", name);
}

// This rank's candidate items (its plan) in source order: tensor chunks, then bytes.
struct Candidates {
  std::vector<PlannedItem> items;
  std::vector<std::pair<size_t, Box>> tensors;  // (source, box)
  std::vector<size_t> bytes;
};

Candidates ListCandidates(RankPlan& plan, StateDictKind kind) {
  Candidates out;
  for (size_t i = 0; i < plan.sources.tensors.size(); ++i) {
    const internal::TensorSource& s = plan.sources.tensors[i];
    plan.paths[s.key] = s.object_path;
    // A full save writes each tensor whole, from the rank DCP's dedup picks.
    std::vector<Box> boxes =
        kind == StateDictKind::kSharded ? s.boxes : std::vector<Box>{internal::WholeBox(s.global_size)};
    for (Box& box : boxes) {
      out.items.push_back({internal::ChunkKey(s.key, box.global_offsets),
                           box.numel() * static_cast<int64_t>(c10::elementSize(s.local.scalar_type())), false});
      out.tensors.emplace_back(i, std::move(box));
    }
  }
  for (size_t i = 0; i < plan.sources.bytes.size(); ++i) {
    plan.paths[plan.sources.bytes[i].key] = plan.sources.bytes[i].object_path;
    out.items.push_back({internal::BytesKey(plan.sources.bytes[i].key), 0, true});
    out.bytes.push_back(i);
  }
  return out;
}

// internal::DedupOverWorld, or with a stager whose last save had the same plan on every rank,
// that save's decisions (one all-gather instead of a gather and a scatter).
std::vector<char> Dedup(const comm::ProcessGroupPtr& world, const std::string& error,
                        const std::vector<internal::PlannedItem>& items, Stager* stager, const char* caller) {
  if (stager == nullptr) return internal::DedupOverWorld(world, error, items, caller);
  internal::SavePlanCache& cache = internal::StagerAccess::Cache(*stager);
  std::vector<char> encoded = error.empty() ? internal::EncodePlan(items) : std::vector<char>();
  if (internal::AgreeUnchanged(world, error, cache.has_plan && cache.plan == encoded, caller)) return cache.keep;
  cache.has_plan = false;
  cache.keep = internal::DedupOverWorld(world, "", items, caller);
  cache.plan = std::move(encoded);
  cache.has_plan = true;
  return cache.keep;
}

// What a rank's fragment depends on: its items' keys, dtypes, shapes, offsets and byte lengths.
std::string ItemsSignature(const RankItems& items) {
  std::string out;
  for (const DcpTensorItem& t : items.tensors) {
    absl::StrAppend(&out, t.fqn, "|", static_cast<int>(t.dtype), "|", absl::StrJoin(t.global_size, ","), "|",
                    absl::StrJoin(t.offsets, ","), "|", absl::StrJoin(t.local.sizes(), ","), ";");
  }
  for (const DcpBytesItem& b : items.bytes) absl::StrAppend(&out, b.fqn, "|", b.bytes.size(), ";");
  return out;
}

// Collective over the model's world group.
RankPlan MakePlan(torch::nn::Module& model, const torch::optim::Optimizer* optimizer, const std::string& dir,
                  const SaveOptions& options, const char* caller) {
  RankPlan plan;
  plan.adapter = internal::AdapterFor(model, caller);  // reshards: the same on every rank
  plan.world = plan.adapter->world();
  plan.rank = plan.world ? plan.world->rank() : 0;
  Candidates mine;
  const std::string error = internal::ErrorOf([&] {
    // A checkpoint being overwritten stops being complete before any rank writes (the
    // gather below orders this before every write).
    if (plan.rank == 0) {
      const std::string md = MetadataPath(dir);
      TORCH_CHECK(::unlink(md.c_str()) == 0 || errno == ENOENT, caller, ": cannot remove the old '", md, "' (",
                  std::strerror(errno), ")");
    }
    if (options.kind != StateDictKind::kSharded) plan.adapter->CheckFullSave(caller);
    plan.sources = internal::CollectSaveSources(model, *plan.adapter, optimizer, options.flatten_optimizer_state_dict,
                                                options.stored_fqn);
    internal::AddStateful(options.stateful, plan.sources, caller);
    if (options.kind == StateDictKind::kFullRank0 && plan.rank != 0) return;
    mine = ListCandidates(plan, options.kind);
  });
  const std::vector<char> keep = Dedup(plan.world, error, mine.items, options.stager.get(), caller);
  for (size_t i = 0; i < mine.tensors.size(); ++i) {
    if (keep[i]) plan.tensors.push_back(std::move(mine.tensors[i]));
  }
  for (size_t i = 0; i < mine.bytes.size(); ++i) {
    if (keep[mine.tensors.size() + i]) plan.bytes.push_back(mine.bytes[i]);
  }
  return plan;
}

// An owned, contiguous CPU copy (the snapshot of AsyncSave).
at::Tensor Snapshot(const at::Tensor& t) {
  return t.is_cpu() ? t.clone(at::MemoryFormat::Contiguous) : t.to(at::kCPU).contiguous();
}

// The items this rank writes. Collective in the full kinds (every FSDP tensor is gathered
// on every rank, in source order). `snapshot`: copies the tensors own, into `stager`'s buffers
// when there is one.
// `dtype`: SaveOptions::dtype (a cast copy is the snapshot).
RankItems Materialize(const RankPlan& plan, StateDictKind kind, bool snapshot, std::optional<at::ScalarType> dtype,
                      Stager* stager = nullptr) {
  RankItems items;
  at::NoGradGuard no_grad;
  const bool staged = snapshot && stager != nullptr;
  const auto add = [&](const internal::TensorSource& s, const std::vector<int64_t>& offsets, const at::Tensor& t) {
    const at::ScalarType stored = s.local.scalar_type();
    if (dtype && at::isFloatingType(stored) && stored != *dtype) {
      items.tensors.push_back({s.key, s.global_size, *dtype, offsets,
                               t.to(*dtype, /*non_blocking=*/false,
                                    /*copy=*/true, at::MemoryFormat::Contiguous)});
      return;
    }
    items.tensors.push_back({s.key, s.global_size, stored, offsets,
                             staged     ? t
                             : snapshot ? Snapshot(t)
                                        : t.contiguous()});
  };
  if (kind == StateDictKind::kSharded) {
    for (const auto& [source, box] : plan.tensors) {
      const internal::TensorSource& s = plan.sources.tensors[source];
      add(s, box.global_offsets, internal::BoxOf(s.local, box));
    }
  } else {
    absl::flat_hash_set<size_t> kept;
    for (const auto& [source, box] : plan.tensors) kept.insert(source);
    for (size_t i = 0; i < plan.sources.tensors.size(); ++i) {
      const internal::TensorSource& s = plan.sources.tensors[i];
      at::Tensor full = s.sharded ? s.sharded->Gather(s.local) : s.local;
      if (kept.contains(i)) add(s, std::vector<int64_t>(s.global_size.size(), 0), full);
    }
  }
  if (staged) {
    std::vector<at::Tensor> sources;
    for (const DcpTensorItem& item : items.tensors) sources.push_back(item.local);
    const std::vector<at::Tensor> buffers = internal::StagerAccess::Stage(*stager, sources);
    for (size_t i = 0; i < buffers.size(); ++i) items.tensors[i].local = buffers[i];
  }
  for (size_t i : plan.bytes) {
    const internal::BytesSource& b = plan.sources.bytes[i];
    items.bytes.push_back({b.key, checkpoint::WriteCheckpoint(b.value)});
  }
  return items;
}

void SetObjectPaths(const RankPlan& plan, DcpFragment& fragment) {
  for (checkpoint::DcpEntry& e : fragment.entries) {
    auto it = plan.paths.find(e.fqn);
    if (it != plan.paths.end()) e.object_path = it->second;
  }
}

// Rank 0: the fragments gathered from every rank (ranks that wrote nothing send none).
std::vector<DcpFragment> ParseFragments(const std::vector<std::vector<char>>& all) {
  std::vector<DcpFragment> fragments;
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty())
      fragments.push_back(checkpoint::ParseDcpFragment(all[r], absl::StrCat("rank ", r, "'s fragment")));
  }
  return fragments;
}

std::vector<char> FragmentPayload(const DcpFragment& fragment) {
  return fragment.entries.empty() ? std::vector<char>() : checkpoint::SerializeDcpFragment(fragment);
}

}  // namespace

// Profiler ranges: dcp.save around the phases dcp.save.plan (the plan and the tensors it
// writes), dcp.save.write (this rank's data file) and dcp.save.finish (the fragments to rank
// 0, `.metadata`), after torch/distributed/checkpoint/state_dict_saver.py's local_step /
// write_data / finish_checkpoint.
void Save(torch::nn::Module& model, const torch::optim::Optimizer* optimizer, const std::string& dir,
          const SaveOptions& options) {
  static const comm::ProfilerLabel kSave("dcp.save"), kPlan("dcp.save.plan"), kWrite("dcp.save.write"),
      kFinish("dcp.save.finish");
  comm::ProfilerRange save_range(kSave);
  std::optional<comm::ProfilerRange> phase(std::in_place, kPlan);
  const RankPlan plan = MakePlan(model, optimizer, dir, options, "dcp::Save");
  const comm::ProcessGroupPtr& world = plan.world;
  const RankItems items = Materialize(plan, options.kind, /*snapshot=*/false, options.dtype);
  phase.reset();
  phase.emplace(kWrite);
  DcpFragment fragment;
  const std::string error = internal::ErrorOf([&] {
    if (items.empty()) return;
    fragment = checkpoint::WriteRankData(dir, plan.rank, items.tensors, items.bytes);
    SetObjectPaths(plan, fragment);
    if (options.on_rank_file_written) options.on_rank_file_written(DataFilePath(dir, plan.rank));
  });
  phase.reset();
  phase.emplace(kFinish);
  const auto all = internal::GatherOrThrow(world, error, FragmentPayload(fragment), 0, "dcp::Save");
  std::string md_error;
  if (plan.rank == 0) md_error = internal::ErrorOf([&] { checkpoint::WriteMetadata(dir, ParseFragments(all)); });
  const std::vector<char> root_error =
      comm::BroadcastBytes(world, std::vector<char>(md_error.begin(), md_error.end()), 0);
  TORCH_CHECK(md_error.empty(), md_error);
  TORCH_CHECK(root_error.empty(), "dcp::Save: rank 0 failed: ", std::string(root_error.begin(), root_error.end()));
}

// ------------------------------------------------------------------------- AsyncSave
struct AsyncSaveHandle::State {
  std::thread thread;
  std::atomic<bool> finished{false};
  std::string error;  // written by the thread before `finished`
  std::mutex join_mu;
  bool waited = false;  // under join_mu: wait() reported the outcome
};

AsyncSaveHandle::AsyncSaveHandle() = default;
AsyncSaveHandle::AsyncSaveHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}
AsyncSaveHandle::AsyncSaveHandle(AsyncSaveHandle&&) noexcept = default;
AsyncSaveHandle& AsyncSaveHandle::operator=(AsyncSaveHandle&& other) noexcept {
  if (this != &other) {
    if (state_) {
      std::lock_guard<std::mutex> lock(state_->join_mu);
      if (state_->thread.joinable()) state_->thread.join();
    }
    state_ = std::move(other.state_);
  }
  return *this;
}
AsyncSaveHandle::~AsyncSaveHandle() {
  if (!state_) return;
  std::lock_guard<std::mutex> lock(state_->join_mu);
  if (state_->thread.joinable()) state_->thread.join();
  // A destructor must not throw, but a failed checkpoint must not pass unnoticed either (the
  // directory has no `.metadata`): say so on stderr when nobody waited for the outcome.
  if (!state_->waited && !state_->error.empty()) {
    TORCH_WARN("dcp::AsyncSave failed and its handle was destroyed without wait(): ", state_->error);
  }
}

void AsyncSaveHandle::wait() {
  TORCH_CHECK(state_ != nullptr, "AsyncSaveHandle::wait: the handle holds no save (moved from or default)");
  {
    std::lock_guard<std::mutex> lock(state_->join_mu);
    if (state_->thread.joinable()) state_->thread.join();
    state_->waited = true;
  }
  TORCH_CHECK(state_->error.empty(), state_->error);
}

bool AsyncSaveHandle::done() const { return state_ == nullptr || state_->finished.load(); }

AsyncSaveHandle AsyncSave(torch::nn::Module& model, const torch::optim::Optimizer* optimizer, const std::string& dir,
                          const SaveOptions& options, comm::ProcessGroupPtr background_group) {
  TORCH_CHECK(!(options.dtype && options.stager), kAsyncSave, ": SaveOptions::dtype (", c10::toString(*options.dtype),
              ") with a stager: its buffers hold the tensors' own dtypes");
  RankPlan plan = MakePlan(model, optimizer, dir, options, kAsyncSave);
  const comm::ProcessGroupPtr world = plan.world;
  // The previous save through the stager still reads its buffers until its file is written.
  if (options.stager) internal::StagerAccess::WaitIdle(*options.stager);
  auto items = std::make_shared<RankItems>(
      Materialize(plan, options.kind, /*snapshot=*/true, options.dtype, options.stager.get()));
  DcpFragment predicted;
  std::vector<char> payload;
  const std::string error = internal::ErrorOf([&] {
    // Items as the stager's last save's: its predicted fragment.
    internal::SavePlanCache* cache = options.stager ? &internal::StagerAccess::Cache(*options.stager) : nullptr;
    std::string signature = cache != nullptr ? ItemsSignature(*items) : std::string();
    if (cache != nullptr && cache->has_fragment && cache->items == signature) {
      predicted = cache->fragment;
      payload = cache->payload;
      return;
    }
    predicted = checkpoint::PredictRankData(plan.rank, items->tensors, items->bytes);
    SetObjectPaths(plan, predicted);
    payload = FragmentPayload(predicted);
    if (cache != nullptr) {
      cache->has_fragment = true;
      cache->items = std::move(signature);
      cache->fragment = predicted;
      cache->payload = payload;
    }
  });
  // The fragments go to rank 0 on the writing thread, over the background group: only
  // `.metadata` needs them, so the step does not wait for that gather (nor rank 0 for their
  // parse); an error above is reported there too, on every rank, at wait().
  const comm::ProcessGroupPtr group = internal::BackgroundGroup(world, std::move(background_group), kAsyncSave);
  const int rank = plan.rank;
  auto paths = std::make_shared<RankPlan>(std::move(plan));
  paths->sources = {};  // the thread needs only the object paths; the model's tensors stay here
  paths->adapter.reset();
  std::shared_ptr<std::promise<void>> release =
      options.stager ? internal::StagerAccess::MarkBusy(*options.stager) : nullptr;
  // With async staging the copy into the buffers may still be running.
  device::EventPtr staged = options.stager ? internal::StagerAccess::StagingEvent(*options.stager) : nullptr;
  return internal::StartAsyncSave([items, paths, predicted = std::move(predicted), payload = std::move(payload), error,
                                   dir, rank, group, on_written = options.on_rank_file_written, release, staged] {
    std::string err = error;
    if (err.empty()) {
      err = internal::ErrorOf([&] {
        if (staged != nullptr) staged->Synchronize(comm::kDefaultTimeout);
        if (items->empty()) return;
        DcpFragment written = checkpoint::WriteRankData(dir, rank, items->tensors, items->bytes);
        SetObjectPaths(*paths, written);
        TORCH_CHECK(written.entries == predicted.entries, kAsyncSave, ": rank ", rank, " wrote '",
                    checkpoint::DcpDataFileName(rank), "' in '", dir,
                    "' with another layout than the one it announced to rank 0 (an archive length that depends on "
                    "the values?); the checkpoint stays incomplete");
        if (on_written) on_written(DataFilePath(dir, rank));
      });
    }
    items->tensors.clear();             // the snapshot is on disk: free it before waiting for the others
    if (release) release->set_value();  // and the stager's buffers may take the next one
    const auto gathered = internal::GatherOrThrow(group, err, payload, 0, kAsyncSave);
    std::string md_error;
    if (rank == 0) md_error = internal::ErrorOf([&] { checkpoint::WriteMetadata(dir, ParseFragments(gathered)); });
    const std::vector<char> root = comm::BroadcastBytes(group, std::vector<char>(md_error.begin(), md_error.end()), 0);
    TORCH_CHECK(md_error.empty(), md_error);
    TORCH_CHECK(root.empty(), kAsyncSave, ": rank 0 failed: ", std::string(root.begin(), root.end()));
  });
}

namespace internal {

AsyncSaveHandle StartAsyncSave(std::function<void()> body) {
  auto state = std::make_shared<AsyncSaveHandle::State>();
  state->thread = std::thread([state, body = std::move(body)] {
    state->error = ErrorOf(body);
    state->finished.store(true);
  });
  return AsyncSaveHandle(std::move(state));
}

}  // namespace internal

}  // namespace fsdp::dcp

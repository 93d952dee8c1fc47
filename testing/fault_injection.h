// Helpers for fault-injection tests (comm::FaultyProcessGroup on rank 0): run the faulted
// call and check it failed on every rank in time with the right error; the whole
// "train, checkpoint, fault, check the state, restore on new groups, compare with a
// fault-free run" scenario for any FSDP model type.
#ifndef FSDP_TESTING_FAULT_INJECTION_H_
#define FSDP_TESTING_FAULT_INJECTION_H_

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/ordered_dict.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/faulty_process_group.h"
#include "testing/multi_rank.h"

namespace fsdp::testing {

// A fault on rank 0 and what every rank must report.
struct FaultScenario {
  comm::Fault fault;
  // A substring of the faulted rank's (rank 0's) error; the other ranks time out on the
  // collective rank 0 never joined ("timed out after <collective_timeout> ms").
  std::string rank0_error;
  comm::Timeout collective_timeout{500};
  // Every rank's error must come within this much time of the faulted call's start.
  std::chrono::milliseconds limit{5000};
};

// What `rank`'s error must contain.
inline std::string ExpectedFaultError(const FaultScenario& scenario, int rank) {
  return rank == 0 ? scenario.rank0_error
                   : absl::StrCat("timed out after ", scenario.collective_timeout.count(), " ms");
}

// Arms `scenario.fault` on `group` when it is rank 0's, runs `faulted` (the call that must
// fail on every rank) and checks its error: present, in time, with the expected text.
// Returns the error message ("" if `faulted` did not throw).
inline std::string ExpectFaultSurfaces(comm::FaultyProcessGroup& group, const FaultScenario& scenario,
                                       const std::function<void()>& faulted) {
  using Clock = std::chrono::steady_clock;
  const int rank = group.rank();
  if (rank == 0) group.Arm({scenario.fault});
  const int64_t injected_before = group.injected();
  const auto start = Clock::now();
  std::string error;
  try {
    faulted();
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  EXPECT_LT(elapsed, scenario.limit) << "rank " << rank << " took " << elapsed.count() << " ms to fail";
  if (rank == 0) {
    EXPECT_EQ(group.injected(), injected_before + 1) << "the fault was not injected";
  }
  const std::string expected = ExpectedFaultError(scenario, rank);
  EXPECT_TRUE(absl::StrContains(error, expected))
      << "rank " << rank << ": expected an error containing '" << expected << "', got '" << error << "'";
  return error;
}

// Expects `call` to fail as a poisoned FSDP model (either FSDP) must: the message names
// `caller`, the poisoning error (`cause`) and the way out.
inline void ExpectPoisonedCall(const std::function<void()>& call, const std::string& caller, const std::string& cause) {
  try {
    call();
    ADD_FAILURE() << caller << " succeeded on a poisoned FSDP model";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const std::string& part : {absl::StrCat(caller, ": FSDP cannot continue after an earlier error on this rank"),
                                    cause, std::string("Load the last state dict into a newly built model")}) {
      EXPECT_TRUE(absl::StrContains(message, part)) << "missing '" << part << "' in: " << message;
    }
  }
}

// A (full) state dict as a map by name, for comparisons.
inline std::map<std::string, at::Tensor> ToMap(const torch::OrderedDict<std::string, at::Tensor>& state_dict) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : state_dict) out.emplace(item.key(), item.value());
  return out;
}

// Copies of `params` (a model's local shards) and of their AdamW state, in `params` order.
inline std::vector<at::Tensor> CopyParamsAndAdamWState(torch::optim::AdamW& opt,
                                                       const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : params) {
    out.push_back(p.detach().clone());
    auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it == opt.state().end()) continue;
    const auto& adamw = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    out.push_back(adamw.exp_avg().clone());
    out.push_back(adamw.exp_avg_sq().clone());
    out.push_back(at::scalar_tensor(static_cast<double>(adamw.step())));
  }
  return out;
}

// Model: one rank's FSDP model + optimizer, with
//   Model(const comm::ProcessGroupPtr& group, uint64_t seed)   // same seed: same init
//   void Train(int first_step, int steps)                        // rank's slice of each batch
//   Model::Checkpoint Save()                                     // full model + optimizer state, every rank
//   void Load(const Model::Checkpoint&)                          // local
//   std::map<std::string, at::Tensor> FullParams()               // collective
//   std::vector<at::Tensor> LocalState()                         // copies of this rank's shards + optimizer state
//   void ExpectPoisoned(const std::string& cause)                // later calls fail naming `cause`
enum class AfterFault {
  kPoisoned,   // the fault hit inside FSDP's hooks: every later FSDP call must fail, naming it
  kUnchanged,  // a state-dict gather failed: the model's and optimizer's local state is untouched
};

// On 2 threaded ranks: train step 0, checkpoint, fault `faulted` (rank 0's group; every rank
// must fail in time), check the state per `after`; then load the checkpoint into a new model
// on new groups, train steps 1 .. kSteps - 1 and expect exactly the parameters of a
// fault-free run of steps 0 .. kSteps - 1.
template <class Model>
void RunFaultThenRestore(const FaultScenario& scenario, AfterFault after, const std::function<void(Model&)>& faulted) {
  constexpr int kWorld = 2, kSteps = 4;
  std::mutex mu;
  std::map<std::string, at::Tensor> reference;
  RunOnRanks(Backend::kThreaded, kWorld, [&](const comm::ProcessGroupPtr& pg) {
    Model model(pg, 11);
    model.Train(0, kSteps);
    std::map<std::string, at::Tensor> params = model.FullParams();
    std::lock_guard<std::mutex> lock(mu);
    if (pg->rank() == 0) reference = std::move(params);
  });

  typename Model::Checkpoint saved;
  RunOptions options;
  options.collective_timeout = scenario.collective_timeout;
  RunOnRanks(
      Backend::kThreaded, kWorld,
      [&](const comm::ProcessGroupPtr& pg) {
        auto faulty = std::make_shared<comm::FaultyProcessGroup>(pg, std::vector<comm::Fault>{});
        Model model(faulty, 11);
        model.Train(0, 1);
        const typename Model::Checkpoint checkpoint = model.Save();
        if (pg->rank() == 0) {
          std::lock_guard<std::mutex> lock(mu);
          saved = checkpoint;
        }
        const std::vector<at::Tensor> before = model.LocalState();
        ExpectFaultSurfaces(*faulty, scenario, [&] { faulted(model); });
        if (after == AfterFault::kPoisoned) {
          model.ExpectPoisoned(ExpectedFaultError(scenario, pg->rank()));
          return;
        }
        const std::vector<at::Tensor> now = model.LocalState();
        ASSERT_EQ(now.size(), before.size());
        for (size_t i = 0; i < now.size(); ++i) EXPECT_TRUE(at::equal(now[i], before[i])) << "local state tensor " << i;
        // Not poisoned: the (local) load of the last checkpoint still works.
        EXPECT_NO_THROW(model.Load(checkpoint));
      },
      options);

  RunOnRanks(Backend::kThreaded, kWorld, [&](const comm::ProcessGroupPtr& pg) {
    Model model(pg, 99);  // other initial values: everything must come from the checkpoint
    model.Load(saved);
    model.Train(1, kSteps - 1);
    const std::map<std::string, at::Tensor> params = model.FullParams();
    EXPECT_EQ(params.size(), reference.size());
    for (const auto& [name, expected] : reference) {
      auto it = params.find(name);
      if (it == params.end()) {
        ADD_FAILURE() << "no parameter " << name << " after the restore";
        continue;
      }
      EXPECT_TRUE(at::equal(it->second, expected))
          << name << ": max |restored - fault-free| = " << (it->second - expected).abs().max().template item<double>();
    }
  });
}

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_FAULT_INJECTION_H_

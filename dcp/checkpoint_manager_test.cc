// The checkpoint manager (dcp/checkpoint_manager.h): saves at the interval (synchronous and
// async), keeps the newest k complete checkpoints and purges older leftovers only, resumes
// bitwise from the newest complete one (or load_step) with its Stateful objects, excludes what
// it is told, saves only the model last, and names bad options.
#include <sys/mount.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "dcp/checkpoint_manager.h"
#include "dcp/dcp_test_trainees.h"
#include "dcp/dict_state_testing.h"

namespace fsdp::dcp {
namespace {

std::vector<std::string> StepDirs(const std::string& folder) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(folder)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

StateDict Counter(int64_t step) { return {{"step", step}}; }

class CheckpointManagerRuns : public ::testing::TestWithParam<bool> {};

TEST_P(CheckpointManagerRuns, SavesAtTheIntervalKeepsKAndResumesBitwise) {
  const bool async = GetParam();
  const std::string folder = NewDir(async ? "manager_async" : "manager_sync");
  const CheckpointManagerOptions options{
      .folder = folder, .interval = 2, .keep_latest_k = 2, .async = async, .last_save_model_only = false};
  std::vector<double> uninterrupted;
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    DictState train(Counter(0));
    CheckpointManager manager(*t.module, t.opt.get(), {{"train_state", &train}}, options, pg);
    EXPECT_EQ(manager.Load(), -1);  // a fresh run
    for (int64_t step = 1; step <= 6; ++step) {
      Train(t, static_cast<int>(step), 1);
      train.state = Counter(step);
      manager.Save(step);
    }
    manager.Wait();
    const std::vector<double> after = Train(t, 7, 2);
    if (pg->rank() == 0) uninterrupted = after;
  });
  // Saved at 2, 4, 6; the newest two kept.
  EXPECT_EQ(StepDirs(folder), (std::vector<std::string>{"step-4", "step-6"}));

  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 99);  // other weights: the checkpoint replaces them
    DictState train(Counter(-1));
    CheckpointManager manager(*t.module, t.opt.get(), {{"train_state", &train}}, options, pg);
    EXPECT_EQ(manager.Load(), 6);
    EXPECT_EQ(train.state.at("step").toInt(), 6);
    const std::vector<double> resumed = Train(t, 7, 2);
    if (pg->rank() == 0) {
      EXPECT_EQ(resumed, uninterrupted);  // same mesh: bitwise
    }
  });
}

INSTANTIATE_TEST_SUITE_P(SyncAndAsync, CheckpointManagerRuns, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "async" : "sync");
                         });

TEST(CheckpointManager, LoadStepExclusionsLeftoversAndTheModelOnlyLastSave) {
  const std::string folder = NewDir("manager_options");
  fsdp2::FullStateDict last;
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    DictState train(Counter(0));
    CheckpointManagerOptions options{
        .folder = folder, .interval = 2, .keep_latest_k = 3, .export_dtype = at::kBFloat16};
    CheckpointManager manager(*t.module, t.opt.get(), {{"train_state", &train}}, options, pg);
    for (int64_t step = 1; step <= 4; ++step) {
      Train(t, static_cast<int>(step), 1);
      train.state = Counter(step);
      manager.Save(step);
    }
    if (pg->rank() == 0) {
      // A leftover older than the newest complete checkpoint (purged at the next save) and a
      // newer one (a save in flight elsewhere, or a crash: never loaded, not purged).
      std::filesystem::create_directories(folder + "/step-3");
      std::filesystem::create_directories(folder + "/step-9");
    }
    pg->barrier()->wait();
    DictState probe(Counter(-1));
    {
      CheckpointManager reader(*t.module, t.opt.get(), {{"train_state", &probe}}, options, pg);
      EXPECT_EQ(reader.Load(), 4);  // step-9 is incomplete
      EXPECT_EQ(probe.state.at("step").toInt(), 4);
    }
    {
      options.load_step = 2;
      options.exclude_from_loading = {"train_state"};
      CheckpointManager reader(*t.module, t.opt.get(), {{"train_state", &probe}}, options, pg);
      probe.loads = 0;
      EXPECT_EQ(reader.Load(), 2);
      EXPECT_EQ(probe.loads, 0);
    }
    // The last save: the model alone (torchtitan's last_save_model_only default), in export_dtype.
    manager.Save(5, /*last_step=*/true);
    fsdp2::FullStateDict full = fsdp2::GetFullStateDict(*t.module);
    if (pg->rank() == 0) last = std::move(full);
  });
  EXPECT_EQ(StepDirs(folder), (std::vector<std::string>{"step-2", "step-4", "step-5", "step-9"}));
  const checkpoint::DcpMetadata md = checkpoint::ReadMetadata(folder + "/step-5");
  for (const auto& e : md.entries) {
    EXPECT_TRUE(absl::StartsWith(e.fqn, "model.")) << e.fqn;
    EXPECT_EQ(e.properties.dtype, at::kBFloat16) << e.fqn;
  }
  // It loads (cast back to the model's float32 on 3 ranks) as the model rounded to bfloat16.
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(3), pg, 99);
    Load(*t.module, nullptr, folder + "/step-5");
    const fsdp2::FullStateDict got = fsdp2::GetFullStateDict(*t.module);
    if (pg->rank() != 0) return;
    for (const auto& item : last) {
      EXPECT_TRUE(at::equal(*got.find(item.key()), item.value().to(at::kBFloat16).to(at::kFloat))) << item.key();
    }
  });
}

// Storage that fails mid-save, three ways; each is process-wide (both ranks are threads of
// this process) while it is held, and no test output is written meanwhile.
enum class StorageFault {
  // RLIMIT_FSIZE = 0: every write to a regular file fails with EFBIG ("File too large").
  kFileSizeLimit,
  // The folder is a small tmpfs, filled up: ENOSPC ("No space left on device"). Needs mount(2)
  // (root with CAP_SYS_ADMIN); the case is skipped, saying so, where it is refused.
  kDiskFull,
  // The folder made read-only (root, which permissions do not stop, runs the save with the
  // effective uid of `nobody`): EACCES ("Permission denied").
  kNoWritePermission,
};

std::string FaultName(StorageFault f) {
  switch (f) {
    case StorageFault::kFileSizeLimit: return "file_size_limit";
    case StorageFault::kDiskFull: return "disk_full";
    case StorageFault::kNoWritePermission: return "no_write_permission";
  }
  return "?";
}

const char* OsError(StorageFault f) {
  switch (f) {
    case StorageFault::kFileSizeLimit: return "File too large";
    case StorageFault::kDiskFull: return "No space left on device";
    case StorageFault::kNoWritePermission: return "Permission denied";
  }
  return "?";
}

// The folder of a case: a fresh directory, for kDiskFull a 4 MiB tmpfs mounted on it (the
// checkpoints of this test's model take a few KiB each), unmounted by the destructor.
class StorageFolder {
 public:
  StorageFolder(const std::string& name, StorageFault fault) : path_(NewDir(name)) {
    std::filesystem::create_directories(path_);
    if (fault != StorageFault::kDiskFull) return;
    if (::mount("tmpfs", path_.c_str(), "tmpfs", 0, "size=4m") != 0) {
      refused_ = std::string("mount of a tmpfs refused (") + std::strerror(errno) + ")";
      return;
    }
    mounted_ = true;
  }
  ~StorageFolder() {
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
  }
  const std::string& path() const { return path_; }
  const std::string& refused() const { return refused_; }

 private:
  std::string path_, refused_;
  bool mounted_ = false;
};

// Holds `fault` on `folder` for its lifetime.
class FailingStorage {
 public:
  FailingStorage(StorageFault fault, const std::string& folder) : fault_(fault), folder_(folder) {
    switch (fault) {
      case StorageFault::kFileSizeLimit: {
        std::signal(SIGXFSZ, SIG_IGN);  // the write fails instead of killing the process
        ::getrlimit(RLIMIT_FSIZE, &saved_limit_);
        rlimit none = saved_limit_;
        none.rlim_cur = 0;
        ::setrlimit(RLIMIT_FSIZE, &none);
        break;
      }
      case StorageFault::kDiskFull: {
        // Fill what is left, in pages (the last partial page fails with ENOSPC too).
        const std::string filler = folder + "/filler";
        std::FILE* f = std::fopen(filler.c_str(), "wb");
        const std::vector<char> page(4096, 'f');
        while (f != nullptr && std::fwrite(page.data(), 1, page.size(), f) == page.size()) {
        }
        if (f != nullptr) std::fclose(f);
        break;
      }
      case StorageFault::kNoWritePermission:
        std::filesystem::permissions(folder,
                                     std::filesystem::perms::owner_write | std::filesystem::perms::group_write |
                                         std::filesystem::perms::others_write,
                                     std::filesystem::perm_options::remove);
        if (::geteuid() == 0) {
          constexpr uid_t kNobody = 65534;
          changed_uid_ = ::seteuid(kNobody) == 0;
        }
        break;
    }
  }
  ~FailingStorage() {
    switch (fault_) {
      case StorageFault::kFileSizeLimit: ::setrlimit(RLIMIT_FSIZE, &saved_limit_); break;
      case StorageFault::kDiskFull: std::filesystem::remove(folder_ + "/filler"); break;
      case StorageFault::kNoWritePermission:
        if (changed_uid_) ::seteuid(0);
        std::filesystem::permissions(folder_, std::filesystem::perms::owner_write, std::filesystem::perm_options::add);
        break;
    }
  }

 private:
  StorageFault fault_;
  std::string folder_;
  rlimit saved_limit_{};
  bool changed_uid_ = false;
};

// Steps a run takes at most before an async save's failure must have been reported: each waits
// kPollPause, so together a deadline far beyond writing this test's few KiB.
constexpr int kMaxPollSteps = 30000;
constexpr auto kPollPause = std::chrono::milliseconds(2);

class CheckpointManagerStorage : public ::testing::TestWithParam<std::tuple<bool, StorageFault>> {};

// A save that cannot finish is reported on every rank with its directory and the OS error,
// purges nothing, and leaves the newest complete checkpoint loadable. An async one is reported
// at a step without a save of its own (the first Save after every rank's writer ended).
TEST_P(CheckpointManagerStorage, AFailedSaveIsReportedOnEveryRankAndPurgesNothing) {
  const auto [async, fault] = GetParam();
  const StorageFolder storage(absl::StrCat("manager_fail_", async ? "async_" : "sync_", FaultName(fault)), fault);
  if (!storage.refused().empty()) GTEST_SKIP() << storage.refused();
  const std::string& folder = storage.path();
  std::vector<std::string> errors(2);
  std::vector<int64_t> reported_at(2, -1);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    DictState train(Counter(0));
    CheckpointManager manager(*t.module, t.opt.get(), {{"train_state", &train}},
                              {.folder = folder, .interval = 2, .keep_latest_k = 2, .async = async}, pg);
    Train(t, 1, 2);
    train.state = Counter(2);
    manager.Save(2);
    manager.Wait();
    Train(t, 3, 2);
    train.state = Counter(4);
    pg->barrier()->wait();
    try {
      std::optional<FailingStorage> failing;
      if (pg->rank() == 0) failing.emplace(fault, folder);
      pg->barrier()->wait();
      int64_t step = 4;
      try {
        manager.Save(step);  // synchronous: fails here
        // Odd steps: never due at interval 2, so only the save in flight can fail them.
        for (step = 5; step < 5 + 2 * kMaxPollSteps; step += 2) {
          std::this_thread::sleep_for(kPollPause);
          manager.Save(step);
        }
      } catch (const c10::Error& e) {
        errors[pg->rank()] = e.what_without_backtrace();
        reported_at[pg->rank()] = step;
      }
      pg->barrier()->wait();
    } catch (...) {
      errors[pg->rank()] = "unexpected";
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(absl::StrContains(errors[r], folder + "/step-4")) << "rank " << r << ": " << errors[r];
    EXPECT_TRUE(absl::StrContains(errors[r], OsError(fault))) << "rank " << r << ": " << errors[r];
  }
  EXPECT_EQ(reported_at[0], reported_at[1]);  // the same step on both ranks
  // step-2 was neither purged nor damaged: the run resumes from it.
  EXPECT_FALSE(std::filesystem::exists(folder + "/step-4/.metadata"));
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 99);
    DictState train(Counter(-1));
    CheckpointManager manager(*t.module, t.opt.get(), {{"train_state", &train}}, {.folder = folder}, pg);
    EXPECT_EQ(manager.Load(), 2);
    EXPECT_EQ(train.state.at("step").toInt(), 2);
  });
}

INSTANTIATE_TEST_SUITE_P(Faults, CheckpointManagerStorage,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(StorageFault::kFileSizeLimit, StorageFault::kDiskFull,
                                                              StorageFault::kNoWritePermission)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param) ? "async_" : "sync_",
                                               FaultName(std::get<1>(info.param)));
                         });

// At most one save in flight: while step 2's async write is held (its upload hook waits for a
// gate), Save(4) blocks; once the gate opens it returns, and last_wait_seconds() counts the wait
// (at least the time this test waited to see it blocked).
TEST(CheckpointManagerAsync, TheNextSaveWaitsForTheOneInFlightAndSaysHowLong) {
  const std::string folder = NewDir("manager_one_in_flight");
  constexpr auto kBlocked = std::chrono::milliseconds(100);
  std::promise<void> gate;
  const std::shared_future<void> open = gate.get_future().share();
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    DictState train(Counter(0));
    CheckpointManagerOptions options{.folder = folder, .interval = 2, .async = true};
    options.on_rank_file_written = [open](int64_t step, const std::string&) {
      if (step == 2) open.wait();
    };
    CheckpointManager manager(*t.module, t.opt.get(), {{"train_state", &train}}, options, pg);
    Train(t, 1, 2);
    train.state = Counter(2);
    manager.Save(2);  // returns; the write waits at the gate
    Train(t, 3, 2);
    train.state = Counter(4);
    std::future<void> next = std::async(std::launch::async, [&] { manager.Save(4); });
    EXPECT_EQ(next.wait_for(kBlocked), std::future_status::timeout) << "Save(4) did not wait for step 2's save";
    pg->barrier()->wait();
    if (pg->rank() == 0) gate.set_value();
    next.get();
    EXPECT_GE(manager.last_wait_seconds(), std::chrono::duration<double>(kBlocked).count());
    manager.Wait();
  });
  EXPECT_TRUE(std::filesystem::exists(folder + "/step-2/.metadata"));
  EXPECT_TRUE(std::filesystem::exists(folder + "/step-4/.metadata"));
}

// continue_on_save_failure: the failed save is a warning counted on every rank, the run goes on,
// and the next due save (the storage healthy again) is complete; nothing older was purged.
TEST_P(CheckpointManagerRuns, ContinueOnFailureGoesOnAndSavesNextTime) {
  const bool async = GetParam();
  const std::string folder = NewDir(async ? "manager_continue_async" : "manager_continue_sync");
  std::vector<int64_t> failures(2, -1);
  std::vector<std::string> last(2);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    DictState train(Counter(0));
    CheckpointManager manager(
        *t.module, t.opt.get(), {{"train_state", &train}},
        {.folder = folder, .interval = 2, .keep_latest_k = 2, .async = async, .continue_on_save_failure = true}, pg);
    for (int64_t step = 1; step <= 6; ++step) {
      Train(t, static_cast<int>(step), 1);
      train.state = Counter(step);
      if (step == 4) manager.Wait();  // step 2's async write is done before the fault
      pg->barrier()->wait();
      {
        std::optional<FailingStorage> failing;
        if (step == 4 && pg->rank() == 0) failing.emplace(StorageFault::kFileSizeLimit, folder);
        pg->barrier()->wait();
        manager.Save(step);
        if (step == 4) manager.Wait();  // the async write too happens under the fault
        pg->barrier()->wait();
      }
    }
    manager.Wait();
    failures[pg->rank()] = manager.failures();
    last[pg->rank()] = manager.last_failure();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(failures[r], 1) << "rank " << r;
    EXPECT_TRUE(absl::StrContains(last[r], folder + "/step-4")) << "rank " << r << ": " << last[r];
  }
  EXPECT_TRUE(std::filesystem::exists(folder + "/step-2/.metadata"));  // k = 2 complete: 2 and 6
  EXPECT_FALSE(std::filesystem::exists(folder + "/step-4/.metadata"));
  EXPECT_TRUE(std::filesystem::exists(folder + "/step-6/.metadata"));
}

TEST(CheckpointManager, BadOptionsAreNamed) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 1, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(1), pg, 11);
    DictState train(Counter(0));
    const auto make = [&](CheckpointManagerOptions o) {
      CheckpointManager manager(*t.module, t.opt.get(), {{"train_state", &train}}, std::move(o), pg);
    };
    EXPECT_ERROR_CONTAINS(make({}), "CheckpointManager: folder is empty");
    EXPECT_ERROR_CONTAINS(make({.folder = "f", .interval = 0}), "interval must be >= 1, got 0");
    EXPECT_ERROR_CONTAINS(make({.folder = "f", .keep_latest_k = 1}), "keep_latest_k must be 0 (keep all) or >= 2");
    EXPECT_ERROR_CONTAINS(make({.folder = "f", .exclude_from_loading = {"model"}}), "cannot name the model");
    EXPECT_ERROR_CONTAINS(make({.folder = "f", .exclude_from_loading = {"dataloader"}}),
                          "exclude_from_loading names 'dataloader', which is none of optimizer, train_state");
    CheckpointManager missing(*t.module, t.opt.get(), {}, {.folder = NewDir("manager_missing"), .load_step = 3}, pg);
    EXPECT_ERROR_CONTAINS(missing.Load(), "step-3");
    EXPECT_ERROR_CONTAINS(
        AsyncSave(*t.module, t.opt.get(), NewDir("cast_staged"),
                  {.stager = std::make_shared<Stager>(StagerOptions{.pin_memory = false}), .dtype = at::kBFloat16}),
        "SaveOptions::dtype (BFloat16) with a stager");
  });
}

}  // namespace
}  // namespace fsdp::dcp

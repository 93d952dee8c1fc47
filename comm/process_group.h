// ProcessGroup: the one narrow interface every package above comm/ talks to.
#ifndef FSDP_COMM_PROCESS_GROUP_H_
#define FSDP_COMM_PROCESS_GROUP_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/flight_recorder.h"
#include "comm/reduce_op.h"
#include "comm/work.h"

namespace fsdp::comm {

// A group of `size()` ranks running the same sequence of collectives.
//
// Contract (as c10d): every rank of the group issues the same collectives in the same
// order; tensors must be contiguous, and must stay alive and unmodified until the Work
// completes. Collectives are asynchronous: results are in the outputs once Work::wait()
// returns. A ProcessGroup object belongs to one rank and is used from one thread at a time.
//
// The public methods validate their arguments identically for every backend (a
// c10::Error naming the argument and the bad value), then dispatch to the backend.
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // "fake", "threaded", "gloo", "nccl", "trace(<inner>)".
  virtual std::string backend_name() const = 0;

  // The timeout Work::wait() uses when none is given, and the deadline of a collective.
  Timeout timeout() const { return timeout_; }

  // Where collectives of host data (lengths, flags, pickled bytes: what PyTorch does with
  // its object collectives) put their tensors: the CPU, or for a backend that takes only
  // device tensors (NCCL) its device, as torch/distributed/distributed_c10d.py's
  // _get_object_coll_device. Such data is copied there before the collective and back to
  // the host after it (ToObjectCollectiveDevice below).
  c10::Device object_collective_device() const { return DoObjectCollectiveDevice(); }

  // output (size() * input.numel() elements) = concatenation of every rank's input, in
  // rank order. Output may be [W * d0, ...] or [W, ...] or flat.
  WorkPtr all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input);
  // output (input.numel() / size() elements) = reduction over ranks of input's rank-th
  // chunk of the flattened input.
  WorkPtr reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::Sum());
  // In place: tensor = reduction over ranks of tensor.
  WorkPtr all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::Sum());
  // In place: tensor = root's tensor.
  WorkPtr broadcast(const at::Tensor& tensor, int root);
  // Splits along dim 0: input's i-th piece goes to rank i; output's j-th piece comes from
  // rank j. Empty split sizes mean equal pieces (dim 0 must then divide by size()).
  WorkPtr all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                            std::vector<int64_t> output_split_sizes = {}, std::vector<int64_t> input_split_sizes = {});
  WorkPtr barrier();

  // Point-to-point, as c10d's send / recv: `tensor` goes to rank `dst` of this group, where the
  // matching recv(buffer, src = this rank, same tag) fills a buffer of the same shape and
  // dtype. Sends from one rank to another with one tag arrive in the order they were issued,
  // matched with that peer's recvs in the order those were issued. Both are asynchronous: a
  // send may complete before its recv is posted (it may keep a copy), a recv once the data is
  // in `tensor`; Work::wait() times out as a collective's does (Work's detail names the peer
  // and tag). Not in a group's collective order: ranks issue them independently. Errors
  // (c10::Error naming the argument): a peer outside [0, size()) or this rank itself, a
  // negative tag, an undefined or non-contiguous tensor; a shape or dtype differing from the
  // peer's fails both Works where the backend can tell (threaded: always). Gloo cannot: a send
  // larger than its recv ends the process in Gloo's IO thread (gloo::EnforceNotMet, as under
  // PyTorch), a smaller one fills part of the buffer.
  WorkPtr send(const at::Tensor& tensor, int dst, int tag = 0);
  WorkPtr recv(const at::Tensor& tensor, int src, int tag = 0);
  // PyTorch's batch_isend_irecv: every op issued, in list order (the backend may coalesce
  // them), one Work per op appended to `works` (a list the caller may keep from call to call,
  // as the pipeline runtime does per microbatch). Each op is validated before any is issued.
  struct P2POp {
    enum class Kind { kSend, kRecv } kind;
    at::Tensor tensor;
    int peer = -1;
    int tag = 0;
  };
  void batch_isend_irecv(const std::vector<P2POp>& ops, std::vector<WorkPtr>& works);

  // Creates the group of `ranks` (of this group; sorted, unique). Collective over THIS
  // group: every rank calls it with the same `ranks`, in the same order of calls.
  // Returns nullptr on ranks that are not members. `desc` describes it in flight recorder
  // dumps (PyTorch's group_desc, e.g. "mesh_dp"; "undefined" when empty).
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks, const std::string& desc = "");

  // The group as flight recorder dumps name it (comm/flight_recorder.h): "0" and
  // "default_pg" for a group a backend made, "<parent>.<k>" for the k-th subgroup created
  // from a parent, with its description and its members' global ranks (those of the root
  // group it descends from).
  const FlightGroup& flight_group() const { return *identity_; }

 protected:
  ProcessGroup(int rank, int size, Timeout timeout);

  // Backend hooks, called with validated arguments. `description` names the collective
  // for error messages.
  virtual WorkPtr DoAllGather(const at::Tensor& output, const at::Tensor& input) = 0;
  virtual WorkPtr DoReduceScatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) = 0;
  virtual WorkPtr DoAllReduce(const at::Tensor& tensor, ReduceOp op) = 0;
  virtual WorkPtr DoBroadcast(const at::Tensor& tensor, int root) = 0;
  virtual WorkPtr DoAllToAll(const at::Tensor& output, const at::Tensor& input,
                             const std::vector<int64_t>& output_split_sizes,
                             const std::vector<int64_t>& input_split_sizes) = 0;
  virtual WorkPtr DoBarrier() = 0;
  virtual WorkPtr DoSend(const at::Tensor& tensor, int dst, int tag) = 0;
  virtual WorkPtr DoRecv(const at::Tensor& tensor, int src, int tag) = 0;
  virtual std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) = 0;
  // The CPU unless the backend needs another device (see object_collective_device()).
  virtual c10::Device DoObjectCollectiveDevice() const { return c10::Device(c10::kCPU); }
  // The group a decorator forwards to, or nullptr for a backend. Only backends record in the
  // flight recorder (a decorator's inner group records what really ran).
  virtual ProcessGroup* DoInnerGroup() const { return nullptr; }

  // Gives this group (and the groups it forwards to) the flight recorder identity `group`.
  void SetFlightGroup(const FlightGroup& group);

  // "<backend> rank r/W" for messages.
  std::string WhoAmI() const;

 private:
  // Validates an all-gather / reduce-scatter pair: the full buffer holds size() shards.
  void CheckShardedPair(const char* op, const at::Tensor& output, const at::Tensor& input, bool output_is_full) const;
  // Runs `issue` (the backend's Do* call), counted in this rank's traffic and recorded in the
  // flight recorder as `op` with its tensors when this group is a backend.
  template <typename Issue>
  // `traffic`: the tensor whose bytes count as the op's traffic (CollectiveTraffic).
  WorkPtr Recorded(FlightOp op, const at::Tensor* input, const at::Tensor* output, const at::Tensor* traffic,
                   Issue&& issue, int peer = -1);
  void CheckP2P(const char* op, const at::Tensor& tensor, int peer, int tag) const;

  int rank_;
  int size_;
  Timeout timeout_;
  std::shared_ptr<const FlightGroup> identity_;
  int subgroups_created_ = 0;                           // names the next subgroup
  int64_t collectives_issued_ = 0;                      // the flight recorder's collective_seq_id
  int64_t p2p_issued_ = 0;                              // its p2p_seq_id
  int64_t ops_issued_ = 0;                              // its op_id: both
  FlightRecorder* recorder_ = nullptr;                  // this rank's, on the first recorded collective
  FlightRecorder::GroupSlot* recorder_slot_ = nullptr;  // identity_ registered there
};

using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

// "all_reduce(SUM) Float[2, 3]": the text backends use in Work descriptions and traces.
std::string DescribeTensor(const at::Tensor& t);

// `host` (host data: a length, a flag, bytes) where a collective of `group` takes it: on
// group.object_collective_device(), i.e. `host` itself when that is the CPU. Read a
// result back with .cpu().
at::Tensor ToObjectCollectiveDevice(const ProcessGroup& group, const at::Tensor& host);

// Equal split sizes along dim 0 when `splits` is empty, else `splits`.
std::vector<int64_t> ResolveSplits(const std::vector<int64_t>& splits, const at::Tensor& t, int world_size);

}  // namespace fsdp::comm

#endif  // FSDP_COMM_PROCESS_GROUP_H_

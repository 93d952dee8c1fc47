// A streaming writer of torch.save files for the dcp tool (dcp_cli_lib.h): the zip layout of
// torch/serialization.py _save (v2.15.0; `<archive>/data.pkl`, a protocol-2 pickle, plus one
// record `<archive>/data/<key>` per storage and `<archive>/byteorder`), written through
// LibTorch's PyTorchStreamWriter as torch.save itself does.
//
// Why not checkpoint_writer.h (torch::jit::pickle_save): its pickler tags every dict and list
// with torch.jit._pickle globals, which Python's torch.load refuses under its default
// weights_only=True, and it needs every tensor in memory until the archive is done. This one
// pickles a plain value as Python's pickler does (only torch._utils._rebuild_tensor_v2,
// torch.<Type>Storage and collections.OrderedDict are named) and writes each tensor's record
// when it is added, so a caller can drop the tensor before reading the next one.
#ifndef TOOLS_TORCH_SAVE_WRITER_H_
#define TOOLS_TORCH_SAVE_WRITER_H_

#include <ATen/core/ivalue.h>
#include <caffe2/serialize/inline_container.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace dcp_cli {

class TorchSaveWriter {
 public:
  // Writes the archive's bytes, in order, to `sink`, which returns how many it took (all of
  // them, or the archive fails with a c10::Error).
  explicit TorchSaveWriter(std::function<size_t(const void*, size_t)> sink);

  // Writes `t`'s data (a CPU tensor; written contiguous) as the next storage record now and
  // returns a stand-in for it: a tensor of t's dtype and size on the meta device (no data)
  // that Finish pickles as that record.
  at::Tensor Add(const at::Tensor& t);

  // Pickles `root` (None, bool, int, float, str, tuple, list, dict, CPU tensors and Add's
  // stand-ins, nested) as data.pkl and closes the archive. CPU tensors met here get their
  // records now. Anything else is a c10::Error naming it.
  void Finish(const c10::IValue& root);

 private:
  std::string WriteStorage(const at::Tensor& t);
  void Pickle(const c10::IValue& v, int depth);
  void PickleTensor(const at::Tensor& t);
  void Op(uint8_t op) { pickle_.push_back(static_cast<char>(op)); }
  void Le(uint64_t v, int bytes);
  void Int(int64_t v);
  void Float(double v);
  void Str(const std::string& s);
  void Global(const char* module, const std::string& name);
  void IntTuple(c10::IntArrayRef values);

  caffe2::serialize::PyTorchStreamWriter zip_;
  std::string pickle_;
  int64_t next_key_ = 0;
  absl::flat_hash_map<const c10::TensorImpl*, std::string> keys_;  // stand-in -> its record
  std::vector<at::Tensor> stand_ins_;  // kept alive so that no other tensor reuses an address
};

// The whole archive of `value` in memory.
std::vector<char> TorchSaveBytes(const c10::IValue& value);

}  // namespace dcp_cli

#endif  // TOOLS_TORCH_SAVE_WRITER_H_

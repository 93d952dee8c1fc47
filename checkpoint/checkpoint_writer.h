// The writer of checkpoint files: torch.save's zip archive (torch/serialization.py _save,
// v2.15.0) as Python's torch.load, with its default weights_only=True, and our reader
// (checkpoint_reader.h) read it. Records: `<archive>/data.pkl`, `byteorder`, one
// `data/<key>` per tensor storage, `version`.
//
// data.pkl is a protocol-2 pickle that names only the globals torch.load's weights_only
// unpickler allows (torch/_weights_only_unpickler.py): torch._utils._rebuild_tensor_v2,
// torch.<Type>Storage and collections.OrderedDict. Values: None, bool, int, float, str
// (UTF-8), tuples, lists, dicts with str / int / float / bool keys, and CPU tensors of the
// dtypes checkpoint_reader.h reads, nested at most 64 containers deep (what the reader reads).
// A tensor is pickled as Python's torch.save pickles it (torch/_tensor.py
// Tensor.__reduce_ex__): its whole storage, once however many tensors view it, with its
// storage offset, size, stride and requires_grad. Storages are written straight from the
// tensors' memory, CRC-32'd on the way (zip_writer.h), never copied.
//
// Errors are c10::Errors that start with "<caller>: ": a tensor not on the CPU names its
// device (callers move tensors to the CPU first: they know whether to detach, cast, ...),
// anything else not written names what it is. The sink's errors propagate.
#ifndef FSDP_CHECKPOINT_CHECKPOINT_WRITER_H_
#define FSDP_CHECKPOINT_CHECKPOINT_WRITER_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::checkpoint {

// One archive, streamed to a sink.
class TorchSaveWriter {
 public:
  // Takes the archive's bytes in order; it takes all of them or throws.
  using Sink = std::function<void(const char* data, size_t size)>;
  TorchSaveWriter(Sink sink, std::string caller);
  ~TorchSaveWriter();
  TorchSaveWriter(const TorchSaveWriter&) = delete;
  TorchSaveWriter& operator=(const TorchSaveWriter&) = delete;

  // Writes `t`'s elements (a CPU tensor; written contiguous) as the next storage record now
  // and returns a stand-in for it: a tensor of t's dtype and size on the meta device (no
  // data) that Finish pickles as that record. So a caller can write many tensors while
  // holding one: their records before data.pkl, which torch.load does not mind.
  at::Tensor Add(const at::Tensor& t);

  // Pickles `root` as data.pkl, writes the storages of the tensors met in it (Add's
  // stand-ins are written already) and ends the archive. Called once.
  void Finish(const c10::IValue& root);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The bytes of a checkpoint holding `value` (errors start with "WriteCheckpoint: ").
std::vector<char> WriteCheckpoint(const c10::IValue& value);

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_CHECKPOINT_WRITER_H_

// TensorBoard event files, as torch.utils.tensorboard.SummaryWriter writes them for
// add_scalar, without TensorFlow or protobuf: for the trainer's metrics (metrics_log.h,
// metrics.enable_tensorboard).
//
// The file is tensorboard's EventFileWriter's: `events.out.tfevents.<unix seconds, 10
// digits>.<hostname>.<pid>.<n>` in the log directory (n counts the writers of this process
// from 0), a TFRecord stream of Event protobufs: first {wall_time, file_version =
// "brain.Event:2"}, then one {wall_time, step, summary {value {tag, simple_value}}} per
// scalar (a float32, as add_scalar's default old-style summary). A record is the uint64
// length (little endian), the masked CRC-32C of those 8 bytes, the data, the masked CRC-32C of
// the data (masked: ((crc >> 15) | (crc << 17)) + 0xa282ead8).
//
// Contract:
// - The writer owns its file; it is flushed on Flush and closed by the destructor (which
//   flushes and never throws). Scalars added since the last Flush may be buffered until then.
// - Errors: a log directory that cannot be created, or a file that cannot be opened or
//   written (on Flush), is a c10::Error naming the path.
// - Not thread-safe: one thread at a time per writer. Separate writers (each its own file) may
//   be used from separate threads.
#ifndef FSDP_TRAIN_TENSORBOARD_H_
#define FSDP_TRAIN_TENSORBOARD_H_

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>

namespace fsdp::train {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial and final XOR 0xFFFFFFFF):
// Crc32c("123456789") == 0xE3069283.
uint32_t Crc32c(std::string_view data);
// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t MaskedCrc32c(std::string_view data);

class TensorBoardWriter {
 public:
  // Creates `log_dir` (and its parents) and a new event file in it.
  explicit TensorBoardWriter(const std::string& log_dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One Event with the current wall time: `value` as a float32 under `tag` at `step`.
  void AddScalar(const std::string& tag, double value, int64_t step);
  // Writes what is buffered to the file.
  void Flush();

  // The event file's path.
  const std::string& path() const { return path_; }

 private:
  void WriteRecord(const std::string& data);

  std::string path_;
  std::ofstream file_;
};

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_TENSORBOARD_H_

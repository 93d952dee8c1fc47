// See tensorboard.h.
#include "train/tensorboard.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <type_traits>

namespace fsdp::train {
namespace {

constexpr std::array<uint32_t, 256> MakeCrc32cTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1) != 0 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    table[i] = crc;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kCrc32cTable = MakeCrc32cTable();

// Protobuf's wire format, the few pieces an Event of a scalar needs.
void PutVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

template <typename T>
void PutLittleEndian(std::string& out, T v) {
  static_assert(std::is_unsigned_v<T>);
  for (size_t i = 0; i < sizeof(T); ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
}

// Field number and wire type (0 varint, 1 64-bit, 2 length-delimited, 5 32-bit).
void PutKey(std::string& out, uint32_t field, uint32_t wire_type) { PutVarint(out, (field << 3) | wire_type); }

void PutBytes(std::string& out, uint32_t field, std::string_view bytes) {
  PutKey(out, field, 2);
  PutVarint(out, bytes.size());
  out.append(bytes.data(), bytes.size());
}

void PutDouble(std::string& out, uint32_t field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  PutKey(out, field, 1);
  PutLittleEndian(out, bits);
}

void PutFloat(std::string& out, uint32_t field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  PutKey(out, field, 5);
  PutLittleEndian(out, bits);
}

double WallTime() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

// Event fields (tensorflow/core/util/event.proto).
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5;
// Summary.value = 1; Summary.Value.tag = 1, .simple_value = 2 (tensorflow/core/framework/summary.proto).
constexpr uint32_t kSummaryValue = 1, kValueTag = 1, kValueSimpleValue = 2;

// tensorboard's _global_uid: the writers of this process, from 0.
std::atomic<int64_t> writers_made{0};

std::string Hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

}  // namespace

uint32_t Crc32c(std::string_view data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (const char c : data) crc = kCrc32cTable[(crc ^ static_cast<uint8_t>(c)) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t MaskedCrc32c(std::string_view data) {
  const uint32_t crc = Crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& log_dir) {
  std::error_code ec;
  std::filesystem::create_directories(log_dir, ec);
  TORCH_CHECK(!ec && std::filesystem::is_directory(log_dir), "TensorBoard: cannot create the log directory ", log_dir,
              (ec ? ": " + ec.message() : std::string()));
  char name[64];
  std::snprintf(name, sizeof(name), "events.out.tfevents.%010lld.", static_cast<long long>(WallTime()));
  path_ = (std::filesystem::path(log_dir) /
           (name + Hostname() + "." + std::to_string(::getpid()) + "." + std::to_string(writers_made.fetch_add(1))))
              .string();
  file_.open(path_, std::ios::out | std::ios::binary | std::ios::trunc);
  TORCH_CHECK(file_.good(), "TensorBoard: cannot write the event file ", path_);
  std::string event;
  PutDouble(event, kEventWallTime, WallTime());
  PutBytes(event, kEventFileVersion, "brain.Event:2");
  WriteRecord(event);
  Flush();
}

// std::ofstream's destructor flushes and closes; its errors are not exceptions.
TensorBoardWriter::~TensorBoardWriter() = default;

void TensorBoardWriter::AddScalar(const std::string& tag, double value, int64_t step) {
  std::string summary_value;
  PutBytes(summary_value, kValueTag, tag);
  PutFloat(summary_value, kValueSimpleValue, static_cast<float>(value));
  std::string summary;
  PutBytes(summary, kSummaryValue, summary_value);
  std::string event;
  PutDouble(event, kEventWallTime, WallTime());
  if (step != 0) {  // proto3 leaves a default value out
    PutKey(event, kEventStep, 0);
    PutVarint(event, static_cast<uint64_t>(step));
  }
  PutBytes(event, kEventSummary, summary);
  WriteRecord(event);
}

void TensorBoardWriter::Flush() {
  file_.flush();
  TORCH_CHECK(file_.good(), "TensorBoard: cannot write the event file ", path_);
}

void TensorBoardWriter::WriteRecord(const std::string& data) {
  std::string header;
  PutLittleEndian(header, static_cast<uint64_t>(data.size()));
  std::string record = header;
  PutLittleEndian(record, MaskedCrc32c(header));
  record += data;
  PutLittleEndian(record, MaskedCrc32c(data));
  file_.write(record.data(), static_cast<std::streamsize>(record.size()));
  TORCH_CHECK(file_.good(), "TensorBoard: cannot write the event file ", path_);
}

}  // namespace fsdp::train

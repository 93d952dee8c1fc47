#include "fuzz/fuzz_models.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "checkpoint/tensor_dict_file.h"
#include "comm/fake_process_group.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "mesh/device_mesh.h"
#include "optim_state/fsdp2_optim_state.h"
#include "optim_state/optim_state_dict.h"

namespace fsdp::fuzz {

volatile unsigned g_sink;  // TouchTensor's reads are not optimized away

namespace {

using fsdp2::testing::Net;
using fsdp2::testing::NetOptions;

std::unique_ptr<Target> Build() {
  auto t = std::make_unique<Target>();
  t->model = Net(NetOptions{.blocks = 1, .hidden = 5});
  fsdp2::testing::InitDeterministic(*t->model);
  auto mesh = mesh::DeviceMesh::Create(comm::CreateFakeProcessGroup(0, 2), {2});
  for (auto& b : t->model->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
  fsdp2::fully_shard(t->model.ptr(), {.mesh = mesh});
  t->adamw =
      std::make_unique<torch::optim::AdamW>(t->model->parameters(), torch::optim::AdamWOptions(1e-2).amsgrad(true));
  t->sgd = std::make_unique<torch::optim::SGD>(t->model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  fsdp2::testing::TrainSteps(t->model, *t->adamw, 0, 1, 2, 0);
  fsdp2::testing::TrainSteps(t->model, *t->sgd, 1, 1, 2, 0);
  return t;
}

std::vector<char> SaveFull(const checkpoint::TensorDict& sd) { return checkpoint::SerializeTensorDict(sd); }

}  // namespace

Target& SharedTarget() {
  static Target* target = Build().release();
  return *target;
}

NamedBytes FullStateDictSeeds() {
  Target& t = SharedTarget();
  NamedBytes out;
  out.emplace_back("model.pt", SaveFull(fsdp2::GetFullStateDict(*t.model)));
  checkpoint::TensorDict mixed;
  const at::Tensor base = at::arange(24, at::kFloat).reshape({4, 6});
  mixed.insert("view", base.narrow(1, 1, 3));  // offset + strides into a shared storage
  mixed.insert("transposed", base.t());
  mixed.insert("scalar", at::scalar_tensor(2.5, at::kDouble));
  mixed.insert("empty", at::empty({0, 3}));
  for (at::ScalarType dtype : {at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kShort, at::kChar,
                               at::kByte, at::kBool, at::kComplexFloat}) {
    mixed.insert(std::string("dtype_") + c10::toString(dtype), at::arange(3, at::kDouble).to(dtype));
  }
  out.emplace_back("mixed.pt", SaveFull(mixed));
  out.emplace_back("empty.pt", SaveFull(checkpoint::TensorDict()));
  return out;
}

NamedBytes OptimStateSeeds() {
  Target& t = SharedTarget();
  NamedBytes out;
  out.emplace_back("adamw.pt",
                   optim_state::SerializeOptimStateDict(optim_state::GetFullOptimStateDict(*t.model, *t.adamw)));
  out.emplace_back("sgd.pt",
                   optim_state::SerializeOptimStateDict(optim_state::GetFullOptimStateDict(*t.model, *t.sgd)));
  return out;
}

void RunAsIsAndWithFixedCrcs(const uint8_t* data, size_t size, void (*run)(const std::vector<char>&)) {
  std::vector<char> bytes(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size);
  run(bytes);
  if (FixZipCrcs(bytes)) run(bytes);
}

bool FixZipCrcs(std::vector<char>& bytes) {
  auto u16 = [&](size_t at) {
    uint16_t v;
    std::memcpy(&v, &bytes[at], 2);
    return static_cast<size_t>(v);
  };
  auto u32 = [&](size_t at) {
    uint32_t v;
    std::memcpy(&v, &bytes[at], 4);
    return static_cast<size_t>(v);
  };
  const size_t n = bytes.size();
  if (n < 22 || u32(n - 22) != 0x06054b50) return false;
  size_t p = u32(n - 22 + 16);
  const size_t entries = u16(n - 22 + 10);
  bool changed = false;
  for (size_t i = 0; i < entries && p + 46 <= n && u32(p) == 0x02014b50; ++i) {
    const size_t size = u32(p + 24), local = u32(p + 42);
    if (local + 30 <= n && u32(local) == 0x04034b50) {
      const size_t data = local + 30 + u16(local + 26) + u16(local + 28);
      if (data <= n && size <= n - data) {
        uint32_t crc = 0xFFFFFFFFu;
        for (size_t k = data; k < data + size; ++k) {
          crc ^= static_cast<uint8_t>(bytes[k]);
          for (int b = 0; b < 8; ++b) crc = (crc & 1) ? 0xEDB88320u ^ (crc >> 1) : crc >> 1;
        }
        crc ^= 0xFFFFFFFFu;
        if (u32(p + 16) != crc) {
          std::memcpy(&bytes[p + 16], &crc, 4);
          std::memcpy(&bytes[local + 14], &crc, 4);
          changed = true;
        }
      }
    }
    p += 46 + u16(p + 28) + u16(p + 30) + u16(p + 32);
  }
  return changed;
}

void TouchTensor(const at::Tensor& t) {
  if (!t.defined()) return;
  const at::Storage& storage = t.storage();
  const int64_t item = static_cast<int64_t>(t.element_size());
  if (t.numel() > 0) {
    int64_t last = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.size(d) < 0 || t.stride(d) < 0) std::abort();
      last += (t.size(d) - 1) * t.stride(d);
    }
    if (t.storage_offset() < 0 || (last + 1) * item > static_cast<int64_t>(storage.nbytes())) {
      std::fprintf(stderr, "TouchTensor: a %lld-dim tensor reaches byte %lld of a %zu-byte storage\n",
                   static_cast<long long>(t.dim()), static_cast<long long>((last + 1) * item), storage.nbytes());
      std::abort();
    }
  }
  const auto* bytes = static_cast<const volatile unsigned char*>(storage.data());
  unsigned sum = 0;
  for (size_t i = 0; i < storage.nbytes(); ++i) {
    sum += bytes[i];
    if (t.scalar_type() == at::kBool && bytes[i] > 1) {
      std::fprintf(stderr, "TouchTensor: bool storage byte %zu is %u\n", i, static_cast<unsigned>(bytes[i]));
      std::abort();
    }
  }
  g_sink = sum;
}

}  // namespace fsdp::fuzz

#include "fsdp/common/storage.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>
#include <c10/util/Flags.h>

#include <cstdlib>
#include <utility>

// c10's CPU allocator debugging switches (defined in c10/core/alloc_cpu.cpp, not declared in
// its installed headers).
C10_DECLARE_bool(caffe2_cpu_allocator_do_zero_fill);
C10_DECLARE_bool(caffe2_cpu_allocator_do_junk_fill);

namespace fsdp {

namespace {

constexpr size_t kSmallBlockBytes = 4096;

void ReportAndFree(void* ptr) {
  c10::profiledCPUMemoryReporter().Delete(ptr);
  std::free(ptr);
}

class SmallBlockCpuAllocator final : public c10::Allocator {
 public:
  at::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0 || nbytes > kSmallBlockBytes) return c10::GetDefaultCPUAllocator()->allocate(nbytes);
    void* ptr = std::malloc(nbytes);
    if (ptr == nullptr) {
      c10::profiledCPUMemoryReporter().OutOfMemory(nbytes);
      TORCH_CHECK(false, "CpuBufferAllocator: out of memory allocating ", nbytes, " bytes");
    }
    c10::profiledCPUMemoryReporter().New(ptr, nbytes);
    return {ptr, ptr, &ReportAndFree, at::Device(at::kCPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

}  // namespace

c10::Allocator* CpuBufferAllocator() {
  static SmallBlockCpuAllocator* const small = new SmallBlockCpuAllocator();  // never destroyed
  c10::Allocator* base = c10::GetCPUAllocator();
  if (base != c10::GetDefaultCPUAllocator() || FLAGS_caffe2_cpu_allocator_do_zero_fill ||
      FLAGS_caffe2_cpu_allocator_do_junk_fill) {
    return base;
  }
  return small;
}

void FreeStorage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == 0) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(0));
  storage->set_nbytes(0);
}

void AllocStorage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = (t.storage_offset() + t.numel()) * t.element_size();
  if (storage->nbytes() == nbytes) return;
  if (storage->allocator() == c10::GetDefaultCPUAllocator()) storage->set_allocator(CpuBufferAllocator());
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

bool SameStorage(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl();
}

int64_t StorageNbytes(const at::Tensor& t) { return static_cast<int64_t>(t.storage().nbytes()); }

namespace {

// The dispatch keys at::empty gives a strided tensor of this dtype on this device.
c10::DispatchKeySet EmptyKeys(c10::Device device, c10::ScalarType dtype) {
  if (device.is_cpu() && !c10::isQIntType(dtype)) return c10::DispatchKeySet(c10::DispatchKey::CPU);  // the common case
  return c10::DispatchKeySet(c10::computeDispatchKey(dtype, c10::kStrided, device));
}

}  // namespace

at::Tensor AliasStorage(const at::Tensor& base, int64_t storage_offset, c10::IntArrayRef sizes) {
  TORCH_CHECK(base.defined() && base.has_storage(), "AliasStorage: base has no storage");
  int64_t numel = 1;
  for (int64_t s : sizes) {
    TORCH_CHECK(s >= 0, "AliasStorage: negative size in ", sizes);
    numel *= s;
  }
  const int64_t itemsize = static_cast<int64_t>(base.element_size());
  TORCH_CHECK(storage_offset >= 0 &&
                  (numel == 0 || (storage_offset + numel) * itemsize <= static_cast<int64_t>(base.storage().nbytes())),
              "AliasStorage: ", numel, " elements at offset ", storage_offset, " do not fit a storage of ",
              base.storage().nbytes(), " bytes");
  at::Tensor alias = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(base.storage()), EmptyKeys(base.device(), base.scalar_type()), base.dtype());
  c10::TensorImpl* impl = alias.unsafeGetTensorImpl();
  impl->set_storage_offset(storage_offset);
  impl->set_sizes_contiguous(sizes);
  return alias;
}

at::Tensor BytesOf(c10::Storage storage) {
  const auto nbytes = static_cast<int64_t>(storage.nbytes());
  const c10::Device device = storage.device();
  at::Tensor bytes = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), EmptyKeys(device, at::kByte),
                                                              caffe2::TypeMeta::Make<uint8_t>());
  bytes.unsafeGetTensorImpl()->set_sizes_contiguous({nbytes});
  return bytes;
}

at::Tensor NonOwningAlias(const at::Tensor& t) {
  if (!t.is_cpu() || t.layout() != c10::kStrided || c10::isQIntType(t.scalar_type())) {
    return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
  }
  const size_t nbytes = at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.element_size());
  c10::Storage borrowed(c10::Storage::use_byte_size_t(), nbytes, c10::DataPtr(t.data_ptr(), t.device()),
                        /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor alias =
      at::detail::make_tensor<c10::TensorImpl>(std::move(borrowed), EmptyKeys(t.device(), t.scalar_type()), t.dtype());
  alias.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides());
  return alias;
}

at::Tensor EmptyBuffer(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  if (options.device().is_cpu() && options.layout() == c10::kStrided && !options.pinned_memory() &&
      !options.requires_grad()) {
    const c10::ScalarType dtype = options.dtype().toScalarType();
    return at::detail::empty_generic(sizes, CpuBufferAllocator(), EmptyKeys(options.device(), dtype), dtype,
                                     options.memory_format_opt());
  }
  return at::empty(sizes, options);
}

at::Tensor EmptyLike0(const at::Tensor& like) {
  if (!like.is_cpu() || like.layout() != c10::kStrided) return at::empty({0}, like.options());
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, c10::GetCPUAllocator(), /*resizable=*/true);
  at::Tensor empty = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), EmptyKeys(like.device(), like.scalar_type()), like.dtype());
  empty.unsafeGetTensorImpl()->set_sizes_contiguous({0});
  return empty;
}

}  // namespace fsdp

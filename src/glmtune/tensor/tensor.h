#pragma once
// A strided n-d array on the CPU or a CUDA device. Tensors share their storage: views (slice,
// select, transpose, view) alias it, `clone` and `contiguous` copy. There is no autograd here:
// modules own their forward and backward explicitly.

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/tensor/device.h"
#include "glmtune/tensor/dtype.h"

namespace glmtune {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& shape);
int64_t shape_numel(const Shape& shape);
Shape contiguous_strides(const Shape& shape);

class Storage {
 public:
  // Allocates `bytes` from the device's allocator.
  Storage(size_t bytes, Device device);
  // Wraps memory owned elsewhere (an mmap'd file, a caller's buffer); `owner` is kept alive as long
  // as any tensor uses the memory.
  Storage(void* data, size_t bytes, Device device, std::shared_ptr<const void> owner);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool owns_memory() const { return owner_ == nullptr; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
  std::shared_ptr<const void> owner_;
};

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor full(const Shape& shape, double value, DType dtype, Device device = Device::cpu());
  // A tensor over memory owned by `owner` (no copy). `data` must stay valid while owner lives.
  static Tensor from_external(void* data, const Shape& shape, DType dtype, Device device,
                              std::shared_ptr<const void> owner);
  // The view `shape` / `strides` (in elements of `dtype`) at element `offset` of `storage`, which
  // must hold it: how a tensor is rebuilt over a copy of its storage on another device.
  static Tensor from_storage(std::shared_ptr<Storage> storage, int64_t offset, const Shape& shape,
                             const Shape& strides, DType dtype);
  // Copies host values into a new CPU tensor of the matching dtype.
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape);
  // Converting constructor for tests and small tables: values are rounded to `dtype`.
  static Tensor from_doubles(const std::vector<double>& values, const Shape& shape, DType dtype);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const;
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return int64_t(shape_.size()); }
  // Negative `d` counts from the end, as in Python.
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t element_size() const { return dtype_size(dtype_); }
  size_t nbytes() const { return size_t(numel()) * element_size(); }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  // Offset of element [0, ..., 0] from the storage start, in elements.
  int64_t storage_offset() const { return offset_; }

  void* data_ptr() const;
  template <typename T>
  T* data() const {
    check_dtype(dtype_of<T>::value);
    return static_cast<T*>(data_ptr());
  }

  // Views (share storage).
  Tensor view(const Shape& shape) const;  // contiguous tensors only; one dimension may be -1
  Tensor slice(int64_t d, int64_t start, int64_t end) const;
  Tensor narrow(int64_t d, int64_t start, int64_t length) const {
    return slice(d, start, start + length);
  }
  Tensor select(int64_t d, int64_t index) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor unsqueeze(int64_t d) const;
  Tensor squeeze(int64_t d) const;
  Tensor flatten() const { return reshape({numel()}); }

  // Copies (new storage).
  Tensor reshape(const Shape& shape) const;  // a view when possible, else a contiguous copy
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor to(DType dtype) const;
  Tensor to(Device device) const;
  // Copies `src` into this tensor elementwise (same shape), converting dtype and crossing devices.
  Tensor& copy_(const Tensor& src);
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }

  // Element access for tests and small host-side tables (CPU tensors only).
  double item(std::initializer_list<int64_t> index = {}) const;
  void set_item(std::initializer_list<int64_t> index, double value);
  // All elements as doubles in row-major order (CPU or CUDA; copies to host).
  std::vector<double> to_doubles() const;

  // A frozen tensor is a parameter that receives no gradient: the backward passes skip its
  // gradient (they neither compute nor allocate one) when given it as a weight. Views of it are
  // frozen too; copies (clone, to, contiguous of a strided view) are not. Off by default.
  bool frozen() const { return frozen_; }
  Tensor& set_frozen(bool frozen = true) {
    frozen_ = frozen;
    return *this;
  }

  // "f32[2, 3] cpu"
  std::string str() const;

 private:
  Tensor(std::shared_ptr<Storage> storage, int64_t offset, Shape shape, Shape strides, DType dtype);
  void check_dtype(DType expected) const;
  int64_t normalize_dim(int64_t d, int64_t ndim_for_insert = -1) const;
  int64_t linear_offset(std::initializer_list<int64_t> index) const;
  // A view of this tensor's storage (offset, shape and strides in elements), frozen like it.
  Tensor derived(int64_t offset, Shape shape, Shape strides) const;

  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::f32;
  bool frozen_ = false;
};

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape) {
  GLMTUNE_ASSERT(int64_t(values.size()) == shape_numel(shape), "{} values for shape {}",
                 values.size(), shape_str(shape));
  Tensor t = empty(shape, dtype_of<T>::value);
  if (!values.empty()) std::memcpy(t.data_ptr(), values.data(), values.size() * sizeof(T));
  return t;
}
template <>
Tensor Tensor::from_vector<bool>(const std::vector<bool>& values, const Shape& shape);

}  // namespace glmtune

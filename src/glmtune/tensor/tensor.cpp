#include "glmtune/tensor/tensor.h"

#include <cstring>
#include <numeric>

#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/convert.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/tensor/cuda_ops.h"
#endif

namespace glmtune {

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

Storage::Storage(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  data_ = bytes ? allocator_for(device).allocate(bytes) : nullptr;
}

Storage::Storage(void* data, size_t bytes, Device device, std::shared_ptr<const void> owner)
    : data_(data), bytes_(bytes), device_(device), owner_(std::move(owner)) {
  GLMTUNE_ASSERT(owner_ != nullptr, "external storage needs an owner");
}

Storage::~Storage() {
  if (!owner_ && data_) allocator_for(device_).deallocate(data_, bytes_);
}

Tensor::Tensor(std::shared_ptr<Storage> storage, int64_t offset, Shape shape, Shape strides,
               DType dtype)
    : storage_(std::move(storage)),
      offset_(offset),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      dtype_(dtype) {}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape)
    GLMTUNE_ASSERT(d >= 0, "negative dimension in shape {}", shape_str(shape));
  auto storage = std::make_shared<Storage>(size_t(shape_numel(shape)) * dtype_size(dtype), device);
  return Tensor(std::move(storage), 0, shape, contiguous_strides(shape), dtype);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::from_external(void* data, const Shape& shape, DType dtype, Device device,
                             std::shared_ptr<const void> owner) {
  auto storage = std::make_shared<Storage>(data, size_t(shape_numel(shape)) * dtype_size(dtype),
                                           device, std::move(owner));
  return Tensor(std::move(storage), 0, shape, contiguous_strides(shape), dtype);
}

Tensor Tensor::from_storage(std::shared_ptr<Storage> storage, int64_t offset, const Shape& shape,
                            const Shape& strides, DType dtype) {
  GLMTUNE_ASSERT(storage != nullptr && shape.size() == strides.size() && offset >= 0,
                 "a view {} with {} strides at offset {} needs a storage", shape_str(shape),
                 strides.size(), offset);
  int64_t last = offset;  // the highest element the view reaches
  for (size_t d = 0; d < shape.size(); ++d) {
    GLMTUNE_ASSERT(shape[d] >= 0 && strides[d] >= 0, "view {} with strides {}", shape_str(shape),
                   shape_str(strides));
    if (shape[d] > 0) last += (shape[d] - 1) * strides[d];
  }
  GLMTUNE_ASSERT(
      shape_numel(shape) == 0 || size_t(last + 1) * dtype_size(dtype) <= storage->bytes(),
      "view {} at offset {} reaches past a storage of {} bytes", shape_str(shape), offset,
      storage->bytes());
  return Tensor(std::move(storage), offset, shape, strides, dtype);
}

template <>
Tensor Tensor::from_vector<bool>(const std::vector<bool>& values, const Shape& shape) {
  GLMTUNE_ASSERT(int64_t(values.size()) == shape_numel(shape), "{} values for shape {}",
                 values.size(), shape_str(shape));
  Tensor t = empty(shape, DType::boolean);
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  for (size_t i = 0; i < values.size(); ++i) p[i] = values[i];
  return t;
}

Tensor Tensor::from_doubles(const std::vector<double>& values, const Shape& shape, DType dtype) {
  Tensor src = from_vector(values, shape);
  return src.to(dtype);
}

Device Tensor::device() const { return storage_ ? storage_->device() : Device::cpu(); }

int64_t Tensor::normalize_dim(int64_t d, int64_t ndim_for_insert) const {
  int64_t n = ndim_for_insert >= 0 ? ndim_for_insert : dim();
  if (d < 0) d += n;
  GLMTUNE_ASSERT(d >= 0 && d < n, "dimension {} out of range for {}", d, str());
  return d;
}

int64_t Tensor::size(int64_t d) const { return shape_[normalize_dim(d)]; }
int64_t Tensor::stride(int64_t d) const { return strides_[normalize_dim(d)]; }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

void* Tensor::data_ptr() const {
  GLMTUNE_ASSERT(defined(), "data of an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_ * int64_t(element_size());
}

void Tensor::check_dtype(DType expected) const {
  GLMTUNE_ASSERT(dtype_ == expected, "tensor {} accessed as {}", str(), dtype_name(expected));
}

Tensor Tensor::view(const Shape& shape) const {
  GLMTUNE_ASSERT(is_contiguous(), "view of non-contiguous tensor {}", str());
  Shape out = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      GLMTUNE_ASSERT(infer < 0, "two -1 dimensions in view {}", shape_str(shape));
      infer = int64_t(i);
    } else {
      known *= out[i];
    }
  }
  if (infer >= 0) {
    GLMTUNE_ASSERT(known > 0 && numel() % known == 0, "cannot view {} as {}", str(),
                   shape_str(shape));
    out[infer] = numel() / known;
  }
  GLMTUNE_ASSERT(shape_numel(out) == numel(), "cannot view {} as {}", str(), shape_str(shape));
  return derived(offset_, out, contiguous_strides(out));
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end) const {
  d = normalize_dim(d);
  GLMTUNE_ASSERT(0 <= start && start <= end && end <= shape_[d], "slice [{}, {}) of dim {} of {}",
                 start, end, d, str());
  Shape shape = shape_;
  shape[d] = end - start;
  return derived(offset_ + start * strides_[d], shape, strides_);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = normalize_dim(d);
  if (index < 0) index += shape_[d];
  GLMTUNE_ASSERT(0 <= index && index < shape_[d], "index {} of dim {} of {}", index, d, str());
  Shape shape = shape_, strides = strides_;
  shape.erase(shape.begin() + d);
  strides.erase(strides.begin() + d);
  return derived(offset_ + index * strides_[d], shape, strides);
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  d0 = normalize_dim(d0);
  d1 = normalize_dim(d1);
  Shape shape = shape_, strides = strides_;
  std::swap(shape[d0], shape[d1]);
  std::swap(strides[d0], strides[d1]);
  return derived(offset_, shape, strides);
}

Tensor Tensor::permute(const std::vector<int64_t>& dims) const {
  GLMTUNE_ASSERT(int64_t(dims.size()) == dim(), "permute needs {} dims", dim());
  Shape shape(dims.size()), strides(dims.size());
  std::vector<bool> seen(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = normalize_dim(dims[i]);
    GLMTUNE_ASSERT(!seen[d], "repeated dim {} in permute", d);
    seen[d] = true;
    shape[i] = shape_[d];
    strides[i] = strides_[d];
  }
  return derived(offset_, shape, strides);
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = normalize_dim(d, dim() + 1);
  Shape shape = shape_, strides = strides_;
  int64_t stride = d < dim() ? strides_[d] * shape_[d] : 1;
  shape.insert(shape.begin() + d, 1);
  strides.insert(strides.begin() + d, stride);
  return derived(offset_, shape, strides);
}

Tensor Tensor::squeeze(int64_t d) const {
  d = normalize_dim(d);
  GLMTUNE_ASSERT(shape_[d] == 1, "squeeze of dim {} of size {}", d, shape_[d]);
  Shape shape = shape_, strides = strides_;
  shape.erase(shape.begin() + d);
  strides.erase(strides.begin() + d);
  return derived(offset_, shape, strides);
}

Tensor Tensor::derived(int64_t offset, Shape shape, Shape strides) const {
  Tensor t(storage_, offset, std::move(shape), std::move(strides), dtype_);
  t.frozen_ = frozen_;
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  return is_contiguous() ? view(shape) : contiguous().view(shape);
}

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
  Tensor out = empty(shape_, dtype_, device());
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return *this;
  Tensor out = empty(shape_, dtype, device());
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  Tensor out = empty(shape_, dtype_, device);
  out.copy_(*this);
  return out;
}

namespace {

// Calls fn(dst_offset, src_offset) for every element, in row-major order of `shape`.
template <typename Fn>
void for_each_offset(const Shape& shape, const Shape& a_strides, const Shape& b_strides, Fn&& fn) {
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  const size_t nd = shape.size();
  std::vector<int64_t> idx(nd, 0);
  int64_t a = 0, b = 0;
  for (int64_t i = 0; i < n; ++i) {
    fn(a, b);
    for (size_t k = nd; k-- > 0;) {
      if (++idx[k] < shape[k]) {
        a += a_strides[k];
        b += b_strides[k];
        break;
      }
      a -= a_strides[k] * (shape[k] - 1);
      b -= b_strides[k] * (shape[k] - 1);
      idx[k] = 0;
    }
  }
}

#ifdef GLMTUNE_WITH_CUDA
cuda_impl::Layout layout_of(const Tensor& t) {
  GLMTUNE_ASSERT(t.dim() <= cuda_impl::kMaxDims, "tensor {} has more than {} dims", t.str(),
                 cuda_impl::kMaxDims);
  cuda_impl::Layout l;
  l.ndim = int(t.dim());
  for (int i = 0; i < l.ndim; ++i) {
    l.shape[i] = t.shape()[i];
    l.strides[i] = t.strides()[i];
  }
  return l;
}
#endif

#ifndef GLMTUNE_WITH_CUDA
[[noreturn]] void no_cuda() {
  throw Error(
      "this glmtune was built without CUDA", "device",
      "rebuild with -DGLMTUNE_CUDA=ON on a machine with the CUDA toolkit, or use --device cpu");
}
#endif

}  // namespace

Tensor& Tensor::copy_(const Tensor& src) {
  GLMTUNE_ASSERT(shape_ == src.shape_, "copy_ from {} into {}", src.str(), str());
  if (numel() == 0) return *this;
  const Device dd = device(), sd = src.device();
  if (dd != sd) {
    // Cross-device: move the bytes as they are, then convert and re-stride on the destination.
    Tensor staged = src.contiguous();
    if (dtype_ == src.dtype_ && is_contiguous()) {
#ifdef GLMTUNE_WITH_CUDA
      cuda_impl::memcpy_bytes(data_ptr(), dd.is_cuda(), staged.data_ptr(), sd.is_cuda(), nbytes());
      return *this;
#else
      no_cuda();
#endif
    }
    Tensor moved = empty(shape_, src.dtype_, dd);
#ifdef GLMTUNE_WITH_CUDA
    cuda_impl::memcpy_bytes(moved.data_ptr(), dd.is_cuda(), staged.data_ptr(), sd.is_cuda(),
                            moved.nbytes());
#else
    no_cuda();
#endif
    return copy_(moved);
  }
  if (dd.is_cuda()) {
#ifdef GLMTUNE_WITH_CUDA
    cuda_impl::copy_strided(dd.index, data_ptr(), dtype_, layout_of(*this), src.data_ptr(),
                            src.dtype_, layout_of(src), numel());
    return *this;
#else
    no_cuda();
#endif
  }
  char* dst = static_cast<char*>(data_ptr());
  const char* sp = static_cast<const char*>(src.data_ptr());
  const int64_t de = int64_t(element_size()), se = int64_t(src.element_size());
  if (dtype_ == src.dtype_ && is_contiguous() && src.is_contiguous()) {
    std::memmove(dst, sp, nbytes());
    return *this;
  }
  const DType dt = dtype_, st = src.dtype_;
  for_each_offset(shape_, strides_, src.strides_, [&](int64_t a, int64_t b) {
    if (dt == st)
      std::memcpy(dst + a * de, sp + b * se, size_t(de));
    else
      convert::convert_element(sp + b * se, st, dst + a * de, dt);
  });
  return *this;
}

Tensor& Tensor::fill_(double value) {
  if (numel() == 0) return *this;
  if (device().is_cuda()) {
#ifdef GLMTUNE_WITH_CUDA
    cuda_impl::fill(device().index, data_ptr(), dtype_, layout_of(*this), numel(), value);
    return *this;
#else
    no_cuda();
#endif
  }
  alignas(8) unsigned char pattern[8];
  convert::store(pattern, dtype_, value);
  char* dst = static_cast<char*>(data_ptr());
  const int64_t es = int64_t(element_size());
  for_each_offset(shape_, strides_, strides_,
                  [&](int64_t a, int64_t) { std::memcpy(dst + a * es, pattern, size_t(es)); });
  return *this;
}

int64_t Tensor::linear_offset(std::initializer_list<int64_t> index) const {
  GLMTUNE_ASSERT(int64_t(index.size()) == dim(), "{} indices for {}", index.size(), str());
  int64_t off = 0, k = 0;
  for (int64_t i : index) {
    if (i < 0) i += shape_[k];
    GLMTUNE_ASSERT(0 <= i && i < shape_[k], "index {} out of range in dim {} of {}", i, k, str());
    off += i * strides_[k++];
  }
  return off;
}

double Tensor::item(std::initializer_list<int64_t> index) const {
  GLMTUNE_ASSERT(device().is_cpu(), "item() of a {} tensor; copy it to the CPU first",
                 device().str());
  const char* p =
      static_cast<const char*>(data_ptr()) + linear_offset(index) * int64_t(element_size());
  return convert::load(p, dtype_);
}

void Tensor::set_item(std::initializer_list<int64_t> index, double value) {
  GLMTUNE_ASSERT(device().is_cpu(), "set_item() of a {} tensor", device().str());
  char* p = static_cast<char*>(data_ptr()) + linear_offset(index) * int64_t(element_size());
  convert::store(p, dtype_, value);
}

std::vector<double> Tensor::to_doubles() const {
  Tensor host = to(Device::cpu()).to(DType::f64).contiguous();
  const double* p = static_cast<const double*>(host.data_ptr());
  return std::vector<double>(p, p + host.numel());
}

std::string Tensor::str() const {
  if (!defined()) return "undefined";
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " " + device().str();
}

}  // namespace glmtune

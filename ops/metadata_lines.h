// Where the tensor metadata that TensorWatch::check() reads lies in memory: the cache lines of the fields it reads,
// for its prefetches (adam_plan.cpp) and for the benchmark's validation floor probe (bench_probes.cpp), which
// touches exactly these lines and nothing else.
//
// A check of thousands of tensors is bound by its cache misses: every TensorImpl, StorageImpl and AutogradMeta is an
// allocation of its own, cold by the next step. The fields a check reads span 3 or 4 of a TensorImpl's lines
// (which ones depends on where malloc put it), 1 or 2 of a StorageImpl's and 1 of an AutogradMeta's. Prefetching
// whole objects from their first byte asks for lines nothing reads and misses some that are read; prefetching the
// lines of the fields read asks for each needed line once.
//
// The offsets come from torch's own headers at compile time (they differ between torch versions: sizes_and_strides_
// is at 64 in torch 2.4 and 56 in 2.13): TensorImpl's fields are protected, so a class derived from it names them;
// the few private ones are located from their declared neighbours, and only prefetches depend on that (a wrong
// guess costs a miss, never a wrong answer: the check reads every field through torch's accessors).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ort_optim::metadata {

constexpr uintptr_t kLine = 64;

inline uintptr_t line_of(const void* p) { return reinterpret_cast<uintptr_t>(p) & ~(kLine - 1); }

// Calls add(line) for each cache line of [p, p + bytes).
template <class Add>
inline void range(const void* p, size_t bytes, Add&& add) {
  const uintptr_t begin = line_of(p), end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t line = begin; line < end; line += kLine) add(line);
}

// TensorImpl's field offsets for the headers this file is compiled against: its protected fields, made public by a
// derived class for offsetof.
struct ImplNames : c10::TensorImpl {
  using c10::TensorImpl::data_type_;
  using c10::TensorImpl::key_set_;
  using c10::TensorImpl::sizes_and_strides_;
  using c10::TensorImpl::storage_;
  using c10::TensorImpl::storage_offset_;
};
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"  // (no virtual bases: offsetof is exact for TensorImpl)
struct ImplFields {
  static constexpr size_t kStorage = offsetof(ImplNames, storage_);
  // autograd_meta_ is private, declared right after storage_ (both versions): the one field located by guess.
  static constexpr size_t kAutogradMeta = kStorage + sizeof(c10::Storage);
  static constexpr size_t kSizesAndStrides = offsetof(ImplNames, sizes_and_strides_);
  static constexpr size_t kStorageOffset = offsetof(ImplNames, storage_offset_);
  static constexpr size_t kDataType = offsetof(ImplNames, data_type_);
  static constexpr size_t kKeySet = offsetof(ImplNames, key_set_);
};
#pragma GCC diagnostic pop

// What a check reads of a TensorImpl. Every role: storage_ (the storage it views), sizes_and_strides_ (its size,
// then the sizes and strides of its dims: inline up to 5 dims, else on the heap), storage_offset_, and data_type_
// with the bytes up to key_set_ (device_opt_ and the bit fields that sizes(), strides(), storage_offset() and
// storage() test before answering: the sizes policy, the storage access check). A param's also autograd_meta_ (its
// gradient). A gradient's also key_set_ (layout() reads it): a watched tensor's layout is its storage's.
enum class Role { kWatched, kParam, kGrad };

template <class Add>
inline void impl_lines(const c10::TensorImpl* t, Role role, int64_t dim, Add&& add) {
  const char* base = reinterpret_cast<const char*>(t);
  range(base + ImplFields::kStorage, sizeof(c10::Storage), add);
  if (role == Role::kParam) range(base + ImplFields::kAutogradMeta, sizeof(void*), add);
  const char* sas = base + ImplFields::kSizesAndStrides;
  range(sas, 2 * sizeof(int64_t), add);  // size_, then the first size or the heap array's pointer
  if (dim <= C10_SIZES_AND_STRIDES_MAX_INLINE_SIZE) {
    range(sas + sizeof(size_t), dim * sizeof(int64_t), add);
    range(sas + sizeof(size_t) + C10_SIZES_AND_STRIDES_MAX_INLINE_SIZE * sizeof(int64_t), dim * sizeof(int64_t), add);
  } else if (role != Role::kGrad) {  // (the heap array, sizes then strides, found through sizes() of a tensor the
    // watch has validated; a gradient's, not validated yet, is not prefetched: sizes() can throw for exotic layouts)
    range(t->sizes().data(), 2 * dim * sizeof(int64_t), add);
  }
  range(base + ImplFields::kStorageOffset, sizeof(int64_t), add);
  range(base + ImplFields::kDataType, ImplFields::kKeySet - ImplFields::kDataType, add);
  if (role == Role::kGrad) range(base + ImplFields::kKeySet, sizeof(c10::DispatchKeySet), add);
}

// Offset of a StorageImpl's data_ptr_ (private; located once through its public accessor), then of size_bytes_,
// declared right after it, and the flags that nbytes() and data() test, declared right after that.
inline size_t storage_data_offset() {
  static const size_t offset = [] {
    const at::Tensor t = at::empty({1}, at::kFloat);
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    return size_t(reinterpret_cast<const char*>(&s->data_ptr()) - reinterpret_cast<const char*>(s));
  }();
  return offset;
}

// What a check reads of a StorageImpl: its size in bytes (size_bytes_ and the flags nbytes() tests), and its data
// pointer where the check compares it (data: states; a params' or step tensors' data is read afresh by each step).
template <class Add>
inline void storage_lines(const c10::StorageImpl* s, bool data, size_t data_offset, Add&& add) {
  const char* data_ptr = reinterpret_cast<const char*>(s) + data_offset;
  if (data) range(data_ptr, sizeof(void*), add);
  range(data_ptr + sizeof(c10::DataPtr), sizeof(c10::SymInt) + 8, add);
}

// A param's gradient, as TensorImpl::grad() finds it without its two calls: autograd's own AutogradMeta holds it
// (torch::autograd::impl::get_autograd_meta casts the same way); a param without autograd meta has none.
inline const at::Tensor* grad_field(const c10::TensorImpl* param) {
  const c10::AutogradMetaInterface* meta = param->autograd_meta();
  return meta == nullptr ? nullptr : &static_cast<const torch::autograd::AutogradMeta*>(meta)->grad_;
}

// What a check reads of a param's AutogradMeta: the grad_ tensor's TensorImpl pointer.
template <class Add>
inline void meta_lines(const c10::AutogradMetaInterface* meta, Add&& add) {
  if (meta != nullptr) range(&static_cast<const torch::autograd::AutogradMeta*>(meta)->grad_, sizeof(void*), add);
}

// What a check reads of param i's planned tensors, in the check's order: the param's TensorImpl and storage, each
// state's (states: per state list, one tensor per param; their data pointers compared), its step tensor's, and its
// AutogradMeta's grad field. compare_data: whether the param's and step tensor's storage data pointers are compared
// too (a bare TensorWatch's; AdamPlan reads them afresh at each step). TensorWatch lists these when it plans; the
// benchmark's validation floor probe lists the same.
template <class Add>
inline void planned_lines(const at::Tensor& param, const std::vector<std::vector<at::Tensor>>& states, size_t i,
                          const at::Tensor& step_tensor, bool compare_data, size_t data_offset, Add&& add) {
  auto watched = [&](const at::Tensor& t, Role role, bool data) {
    impl_lines(t.unsafeGetTensorImpl(), role, t.dim(), add);
    storage_lines(t.storage().unsafeGetStorageImpl(), data, data_offset, add);
  };
  watched(param, Role::kParam, compare_data);
  for (const auto& list : states) watched(list[i], Role::kWatched, true);
  watched(step_tensor, Role::kWatched, compare_data);
  meta_lines(param.unsafeGetTensorImpl()->autograd_meta(), add);
}

// Keeps each line of `lines` at its first place only; `begins` (ascending positions in lines, e.g. where each
// param's lines start) move with the lines they point at. Sorts a copy rather than filling a hash set: a set's
// thousands of small nodes, freed, would take the holes in the heap where the next tensors' metadata goes.
inline void keep_first(std::vector<uintptr_t>& lines, std::vector<uint32_t>& begins) {
  std::vector<uintptr_t> sorted(lines);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  std::vector<char> kept(sorted.size(), 0);
  size_t out = 0, b = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    for (; b < begins.size() && begins[b] == i; ++b) begins[b] = uint32_t(out);
    const size_t k = std::lower_bound(sorted.begin(), sorted.end(), lines[i]) - sorted.begin();
    if (kept[k]) continue;
    kept[k] = 1;
    lines[out++] = lines[i];
  }
  for (; b < begins.size(); ++b) begins[b] = uint32_t(out);
  lines.resize(out);
}

}  // namespace ort_optim::metadata

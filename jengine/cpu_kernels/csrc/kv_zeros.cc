// Zero-filled output buffers for XLA:CPU that cost no page faults until they are used.
//
// XLA fills a jnp.zeros result by writing every byte, so a 2 GiB KV cache costs 2 GiB of
// first-touch page faults at start-up (1.5-5 s in a VM). Here the whole pages inside each
// buffer are instead replaced by a fresh private anonymous mapping (what calloc does for a large
// block): the kernel maps them on first write, as zeros; only the partial pages at the ends
// are written. Where the mapping cannot be replaced (a hugetlb allocator, say), the buffer is
// written with zeros as XLA would. Either way every byte reads zero afterwards.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jengine {
namespace {

constexpr uintptr_t kMinRemapBytes = uintptr_t{1} << 20;  // below this, writing is cheaper

void ZeroOnFirstTouch(void* data, size_t size) {
  if (size == 0) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data), end = begin + size;
  const uintptr_t lo = (begin + page - 1) & ~(page - 1), hi = end & ~(page - 1);
  if (hi <= lo || hi - lo < kMinRemapBytes) {
    std::memset(data, 0, size);
    return;
  }
  std::memset(data, 0, lo - begin);
  std::memset(reinterpret_cast<void*>(hi), 0, end - hi);
  void* mapped = mmap(reinterpret_cast<void*>(lo), hi - lo, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  if (mapped == MAP_FAILED) std::memset(reinterpret_cast<void*>(lo), 0, hi - lo);
}

ffi::Error Zeros(ffi::RemainingRets outs) {
  for (size_t i = 0; i < outs.size(); ++i) {
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (out.has_error()) return out.error();
    ZeroOnFirstTouch((*out)->untyped_data(), (*out)->size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jengine

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JengineZeros(
    XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineZeros, jengine::Zeros, ffi::Ffi::Bind().RemainingRets());

JE_FFI_TARGET("jengine_zeros", JengineZeros);

// The library's one table of FFI targets and instruction-set codes, shared with Python.
//
// Each kernel's .cc names its targets and the `isa` codes its handlers take once, beside the
// handlers (JE_FFI_TARGET, JE_ISAS); the rows are collected as the library loads, and Python
// (jengine/cpu_kernels/library.py) reads them through the JengineTable* functions below:
// it registers every target with XLA and looks every code up by name. A name or code is thus
// written in one place only, and a Python wrapper that asks for one the library lacks fails
// with an error naming it instead of calling a wrong kernel.

#ifndef JENGINE_REGISTRY_H_
#define JENGINE_REGISTRY_H_

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "xla/ffi/api/c_api.h"

namespace jengine {

using FfiHandler = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);
// A kernel's answer to "does code `isa` run here": for 0 (auto), the code auto picks; else 1/0.
using IsaQuery = int (*)(int);

// Adds a row; returns a value only so that a namespace-scope static can call it at load time.
bool AddTarget(const char* name, FfiHandler handler);
bool AddIsas(const char* kernel, IsaQuery runs,
             std::initializer_list<std::pair<const char*, int32_t>> codes);

}  // namespace jengine

#define JE_TABLE_CAT2(a, b) a##b
#define JE_TABLE_CAT(a, b) JE_TABLE_CAT2(a, b)
// The FFI target `name` (what jax.ffi.ffi_call names) served by the handler symbol `handler`.
#define JE_FFI_TARGET(name, handler)                                          \
  [[maybe_unused]] static const bool JE_TABLE_CAT(je_target_, __LINE__) = \
      ::jengine::AddTarget(name, handler)
// The `isa` codes of kernel `kernel` by name, and the function that says which run here.
#define JE_ISAS(kernel, runs, ...)                                          \
  [[maybe_unused]] static const bool JE_TABLE_CAT(je_isas_, __LINE__) = \
      ::jengine::AddIsas(kernel, runs, __VA_ARGS__)

#endif  // JENGINE_REGISTRY_H_

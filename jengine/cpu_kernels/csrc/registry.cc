// The rows JE_FFI_TARGET and JE_ISAS add as the library loads, and the C functions through which
// Python reads them (registry.h says why the table is here).

#include "registry.h"

#include <vector>

#include "isa.h"

namespace jengine {
namespace {

struct TargetRow {
  const char* name;
  FfiHandler handler;
};

struct IsaRow {
  const char* kernel;
  const char* name;
  int32_t code;
  IsaQuery runs;
};

// Function-local statics: built on first use, whichever file's rows load first.
std::vector<TargetRow>& Targets() {
  static std::vector<TargetRow> rows;
  return rows;
}

std::vector<IsaRow>& Isas() {
  static std::vector<IsaRow> rows;
  return rows;
}

bool InRange(int i, size_t size) { return i >= 0 && static_cast<size_t>(i) < size; }

}  // namespace

bool AddTarget(const char* name, FfiHandler handler) {
  Targets().push_back({name, handler});
  return true;
}

bool AddIsas(const char* kernel, IsaQuery runs,
             std::initializer_list<std::pair<const char*, int32_t>> codes) {
  for (const auto& [name, code] : codes) Isas().push_back({kernel, name, code, runs});
  return true;
}

}  // namespace jengine

JE_EXPORT int JengineTableTargets() { return static_cast<int>(jengine::Targets().size()); }

JE_EXPORT const char* JengineTableTargetName(int i) {
  return jengine::InRange(i, jengine::Targets().size()) ? jengine::Targets()[i].name : nullptr;
}

JE_EXPORT void* JengineTableTargetHandler(int i) {
  if (!jengine::InRange(i, jengine::Targets().size())) return nullptr;
  return reinterpret_cast<void*>(jengine::Targets()[i].handler);
}

JE_EXPORT int JengineTableIsas() { return static_cast<int>(jengine::Isas().size()); }

JE_EXPORT const char* JengineTableIsaKernel(int i) {
  return jengine::InRange(i, jengine::Isas().size()) ? jengine::Isas()[i].kernel : nullptr;
}

JE_EXPORT const char* JengineTableIsaName(int i) {
  return jengine::InRange(i, jengine::Isas().size()) ? jengine::Isas()[i].name : nullptr;
}

JE_EXPORT int JengineTableIsaCode(int i) {
  return jengine::InRange(i, jengine::Isas().size()) ? jengine::Isas()[i].code : -1;
}

// Row i's kernel asked whether its code runs here (for auto: the code auto picks).
JE_EXPORT int JengineTableIsaRuns(int i) {
  if (!jengine::InRange(i, jengine::Isas().size())) return 0;
  const auto& row = jengine::Isas()[i];
  return row.runs(row.code);
}

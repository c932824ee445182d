// What every AMX kernel needs before its first tile instruction: the process's permission to
// use the tile state, and the tile shapes. Shared by amx_bf16.h (projections) and
// amx_attention.h (prefill attention).

#ifndef JENGINE_AMX_TILES_H_
#define JENGINE_AMX_TILES_H_

#if defined(__x86_64__)

#include <sys/syscall.h>
#include <unistd.h>

#include <immintrin.h>

#include <cstdint>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

namespace jengine {
namespace amx {

constexpr int64_t kTileRows = 16;  // rows of an A or C tile, k pairs of a B tile
constexpr int64_t kTileK = 32;     // bf16 elements of k in one A tile row

// Linux hands a process the tile state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without that the first tile instruction faults. Asked once per library
// (asking again is harmless).
inline bool Permitted() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512bf16")) {
      return false;
    }
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: C f32 16 x 16, A bf16 16 x 32, B 16 k pairs x 16 columns.
inline void Configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace amx
}  // namespace jengine

#pragma GCC pop_options

#endif  // __x86_64__
#endif  // JENGINE_AMX_TILES_H_

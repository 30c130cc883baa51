// AMX tile helpers shared by the amx level's kernels (cpu_linear_amx.cpp,
// cpu_paged_prefill.cpp): the OS's grant of the tile state, the tile configuration
// (every tile 16 rows x 64 bytes), and 64-byte-aligned storage. Built where the level's
// flags define __AMX_TILE__ / __AMX_BF16__ only.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <new>

namespace tmamx {

// Linux hands a process the tile registers' state only when asked (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); without it the first tile instruction faults.
inline bool request_tiles() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return ok;
}

// Palette 1, all eight tiles 16 rows x 64 bytes (16 fp32 / 32 bf16 a row).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the tile configuration on this thread for a scope, and frees the tiles after
// (a thread left holding tile state makes every context switch save 8 KB more).
struct TileScope {
  TileScope() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

}  // namespace tmamx
#endif

namespace tmamx {
// 64-byte-aligned storage for std::vector: a tile row that straddles two cache lines
// makes every tile load and store about 4x slower (measured on a Xeon with AMX).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}  // NOLINT: allocators convert implicitly
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
}  // namespace tmamx

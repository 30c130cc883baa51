// Fork / join for the kernels' loops: at::parallel_for, or a cheaper hand-off to the
// threads of a team that is already running.
//
// Why: a one-row decode layer runs four or five parallel loops of 5-40 us each, and
// every at::parallel_for is an OpenMP region: ~2 us to fork and join on a 2-thread
// EPYC, ~4 with other work beside it (measured: regions around nothing). A native
// call that runs many such loops (decode_layers) opens one region for all of them
// (with_team); inside it tmpar::parallel_for publishes a loop to the threads waiting
// in that region and joins on a counter (~0.2 us).
//
// The chunks are at::parallel_for's (same count and boundaries for the same number
// of threads, chunk i on thread i, at::get_thread_num() = i inside it), each run whole
// by one thread, so a kernel's results do not depend on which of the two paths ran.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace tmpar {

using ChunkFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// The number of threads of the team the calling thread leads, 0 when it leads none
// (outside with_team's body, on a team's other threads, or inside a chunk).
int team_size();

// Run chunk i = [begin + i * chunk, min(end, begin + (i + 1) * chunk)) of fn on the
// team's thread i, i < nchunks <= team_size(); the calling thread (the leader) runs
// chunk 0 and returns when every chunk is done, rethrowing the first chunk's error.
void team_for(int64_t begin, int64_t end, int64_t chunk, int64_t nchunks, ChunkFn fn,
              const void* ctx);

// body(ctx) on the calling thread while the other threads of one OpenMP region wait
// for its parallel_for loops; just body(ctx) where no team applies (one thread, inside
// a parallel region already, teams switched off).
void run_team(void (*body)(void*), void* ctx);

// Teams on (default) or off (every loop through at::parallel_for: the tests compare
// the two); returns the previous setting.
bool set_teams(bool on);

// Loops handed to a team since the module loaded (the tests' proof that teams ran).
int64_t team_loops();

template <typename Body>
void with_team(Body&& body) {
  run_team([](void* b) { (*static_cast<std::remove_reference_t<Body>*>(b))(); }, &body);
}

// Steps of up to this many rows run their decode loop in a team: there every kernel the
// loops call splits its work through parallel_for below (or is serial at that size).
// Past it some call at::parallel_for themselves (the vdpbf16ps many-row linears from 9
// rows, cpu_linear_dot.cpp), which inside the team's region runs on the leader alone:
// a 16-64-row decode at avx512_bf16 took 1.4x as long in a team. Those steps fork per
// loop, whose cost their larger loops hide.
constexpr int64_t kTeamMaxRows = 8;

// body() in a team when a step of `rows` rows may have one, else as it is.
template <typename Body>
void with_team_for_rows(int64_t rows, Body&& body) {
  if (rows <= kTeamMaxRows) {
    with_team(body);
  } else {
    body();
  }
}

// at::parallel_for(begin, end, grain, f), through the calling thread's team when it
// leads one.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int size = team_size();
  if (size == 0) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t n = end - begin;
  int64_t threads = size;
  if (grain > 0) threads = std::min(threads, (n + grain - 1) / grain);
  if (n <= grain || n <= 1 || threads <= 1) {  // at::parallel_for's serial case
    f(begin, end);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  team_for(begin, end, chunk, (n + chunk - 1) / chunk,
           [](const void* c, int64_t b0, int64_t b1) { (*static_cast<const F*>(c))(b0, b1); },
           &f);
}

}  // namespace tmpar

// Stress harness for exporters/worker_pool.inc (tests/test_worker_pool.py builds and runs it): many back-to-back
// `workers().parallel(count, work)` calls with few indices and more helpers than cores, from `callers` threads at
// once. Every index of every call must run exactly once, before that call returns, and no helper may touch a call
// after it returned. Each call's `work` and its record are kept alive to the end, so a late touch is counted, not
// undefined. Prints one line; exit status 1 on any fault.
//
// Usage: worker_pool_stress [calls per caller] [widest count] [callers]

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#ifdef __linux__
#include <sched.h>
#endif

namespace {
#include "worker_pool.inc"

constexpr int MAX_COUNT = 64;

struct Call {
  std::atomic<int> runs[MAX_COUNT];
  std::atomic<bool> returned{false};
  int count = 0;
  std::function<void(int)> work;
};

struct Faults {
  std::atomic<int64_t> twice{0}, missing{0}, late{0};
};

void spin(int amount) {
  volatile int sink = 0;
  for (int i = 0; i < amount; ++i) sink = sink + i;
}

// One caller's calls: counts alternate between narrow and wide (as product() does: quantizers, then threads), with
// pauses that let the helpers fall asleep (a helper woken by a narrow call it is not wanted in wakes late).
void caller(int calls, int widest, uint32_t seed, std::vector<std::unique_ptr<Call>>& kept, Faults& faults) {
  for (int c = 0; c < calls; ++c) {
    seed = seed * 1664525u + 1013904223u;
    const int narrow = 2 + static_cast<int>((seed >> 8) % 2);
    const int count = c % 2 ? widest : narrow;
    if (c % 8 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));  // helpers fall asleep: they wake late
    auto call = std::make_unique<Call>();
    Call* record = call.get();
    record->count = count;
    for (int i = 0; i < MAX_COUNT; ++i) record->runs[i].store(0);
    const int amount = static_cast<int>((seed >> 16) % 64);
    record->work = [record, &faults, amount](int index) {
      if (record->returned.load()) faults.late++;
      record->runs[index]++;
      spin(amount * (index + 1));
      if (record->returned.load()) faults.late++;
    };
    workers().parallel(count, record->work);
    for (int i = 0; i < count; ++i) {
      const int runs = record->runs[i].load();
      if (runs == 0) faults.missing++;
      if (runs > 1) faults.twice++;
    }
    record->returned.store(true);
    kept.push_back(std::move(call));
  }
}

#ifdef __linux__
// Helpers run on their caller's cores, and follow it when it is moved: pinned to one core, then back to all.
int64_t cores_not_followed() {
  cpu_set_t all, one;
  if (sched_getaffinity(0, sizeof(all), &all) != 0 || CPU_COUNT(&all) < 2) return 0;
  CPU_ZERO(&one);
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &all)) {
      CPU_SET(cpu, &one);
      break;
    }
  int64_t wrong = 0;
  for (const cpu_set_t* wanted : {&one, &all}) {
    if (sched_setaffinity(0, sizeof(*wanted), wanted) != 0) return 0;
    std::atomic<int64_t> bad{0};
    workers().parallel(4, [&](int) {
      cpu_set_t mine;
      if (sched_getaffinity(0, sizeof(mine), &mine) != 0 || !CPU_EQUAL(&mine, wanted)) bad++;
    });
    wrong += bad.load();
  }
  return wrong;
}
#else
int64_t cores_not_followed() { return 0; }
#endif

}  // namespace

int main(int argc, char** argv) {
  const int calls = argc > 1 ? std::atoi(argv[1]) : 20000;
  const int widest = argc > 2 ? std::atoi(argv[2]) : 6;
  const int callers = argc > 3 ? std::atoi(argv[3]) : 1;
  if (widest < 2 || widest > MAX_COUNT || callers < 1) {
    std::fprintf(stderr, "usage: worker_pool_stress [calls] [widest 2..%d] [callers]\n", MAX_COUNT);
    return 2;
  }
  Faults faults;
  std::vector<std::vector<std::unique_ptr<Call>>> kept(callers);
  std::vector<std::thread> threads;
  for (int t = 0; t < callers; ++t)
    threads.emplace_back([&, t] { caller(calls, widest, 12345u + 977u * t, kept[t], faults); });
  for (auto& thread : threads) thread.join();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a helper still at work shows up now
  int64_t after = 0;  // runs counted later than their call's return (beyond the late touches seen in work)
  for (auto& list : kept)
    for (auto& call : list)
      for (int i = 0; i < call->count; ++i) after += call->runs[i].load() > 1;
  const int64_t strays = cores_not_followed();
  std::printf("calls %lld, widest %d, callers %d: twice %lld, missing %lld, late %lld, twice by the end %lld, "
              "helpers off their caller's cores %lld\n", static_cast<long long>(calls) * callers, widest, callers,
              static_cast<long long>(faults.twice.load()), static_cast<long long>(faults.missing.load()),
              static_cast<long long>(faults.late.load()), static_cast<long long>(after),
              static_cast<long long>(strays));
  return faults.twice || faults.missing || faults.late || after || strays ? 1 : 0;
}

// Work items split between threads by their elements: every multi-tensor pass (the Adam kernel, grad_stats, the
// benchmark's floor probes) goes over chunks of many tensors, and a model's many small tensors are one short chunk
// each. at::parallel_for over the items gives each thread as many items; on GPT-2's shapes one of two threads then
// got 56% of the elements. Here each thread takes a run of consecutive items holding an equal share of them.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace ort_optim {

// The items of each thread: thread t takes items [first[t], first[t + 1]), consecutive items whose elements
// (item.end - item.begin) add up, to the nearest item boundary, to an equal share. Which thread runs an item changes
// no result where each item's result depends on that item alone (the callers' contract).
template <typename Item>
std::vector<int64_t> thread_split(const std::vector<Item>& items) {
  const int64_t n = int64_t(items.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> before(n + 1, 0);  // the elements of the items before item k
  for (int64_t k = 0; k < n; ++k) before[k + 1] = before[k] + (items[k].end - items[k].begin);
  std::vector<int64_t> first(threads + 1, n);
  first[0] = 0;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t share = before[n] * t / threads;
    int64_t k = std::lower_bound(before.begin(), before.end(), share) - before.begin();  // before[k] >= share
    if (k > 0 && share - before[k - 1] < before[k] - share) --k;
    first[t] = std::max(first[t - 1], k);
  }
  return first;
}

// at::parallel_for over the items, split by thread_split: body(begin, end) runs items [begin, end) on one thread.
template <typename Item, typename Body>
void parallel_over_items(const std::vector<Item>& items, const Body& body) {
  const std::vector<int64_t> first = thread_split(items);
  at::parallel_for(0, int64_t(first.size()) - 1, 1,
                   [&](int64_t first_thread, int64_t end_thread) { body(first[first_thread], first[end_thread]); });
}

}  // namespace ort_optim

// Partial synchronization schedules: which sync units a worker pushes after which local step
// of its period (paper 003 §3.1-3.4; Streaming DiLoCo). The model is split into K sync units
// (the server's layer groups, contiguous, unit 0 first in forward order). A worker runs a
// period of H local steps; after step h's backward pass it pushes the units of syncs[h], each
// as soon as its own backward has finished. Every unit is synced at least once per period.
// Pure functions: no clock, no threads, no state (docs/algorithms.md, "Partial synchronization
// schedules").
//
// Cost model of one local step (a reconstruction of paper 003 Eq. 7 from its prose):
//   F = sum_u forward[u], B = sum_u backward[u].
//   Backward runs from unit K-1 down to unit 0; unit u's backward ends at
//     E_u = F + sum_{v >= u} backward[v].
//   The link is one FIFO channel. The transfers of the units synced at this step go in push
//   order; unit u's transfer starts at max(E_u, end of the previous transfer of this step) and
//   takes transfer[u].
//   The step lasts max(F + B, end of its last transfer). Synchronization is in place: the next
//   step's forward needs the synced parameters, so transfers never spill into the next step.
//   Overflow of a step = its time - (F + B), the communication not hidden by backward.
// Period time = sum of the H step times. Steps are independent: a step's time depends only on
// its own set.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace aloe {

// Profiled per-unit costs in seconds, in forward order, K entries each.
struct UnitCosts {
  std::vector<double> forward;
  std::vector<double> backward;
  // Push plus pull of the unit, latency included.
  std::vector<double> transfer;

  uint32_t num_units() const { return static_cast<uint32_t>(forward.size()); }
};

// Returns kInvalidArgument naming the field unless K >= 1, the three vectors have K entries
// each, and every entry is finite and >= 0.
absl::Status ValidateUnitCosts(const UnitCosts& costs);

struct SyncSchedule {
  // K: the number of sync units.
  uint32_t num_units = 0;
  // H: local steps per period.
  uint32_t period = 0;
  // syncs[h]: the units pushed right after step h, in push order. The schedules built here list
  // them in descending unit index, the order in which their backward passes end.
  std::vector<std::vector<uint32_t>> syncs;

  // How many times each unit is synced per period (K entries).
  std::vector<uint32_t> SyncCounts() const;
  // "[2 1] [0]": one bracket per step, units in push order.
  std::string ToString() const;
};

// Returns kInvalidArgument unless K >= 1, H >= 1, syncs has H entries, every unit index is
// below K, no step lists a unit twice and every unit is synced at least once.
absl::Status ValidateSchedule(const SyncSchedule& schedule);

enum class ScheduleKind {
  kStrided,      // Streaming DiLoCo fragments at strided offsets ("strided").
  kEqualNumber,  // paper 003 PLSGD-ENP, Example 1 ("enp").
  kDreamDdp,     // paper 003 §3.3 scheduled partition ("dreamddp").
};

// "strided", "enp" or "dreamddp"; kInvalidArgument otherwise.
absl::StatusOr<ScheduleKind> ParseScheduleKind(std::string_view name);
std::string_view ScheduleKindName(ScheduleKind kind);

// Streaming DiLoCo: unit j is pushed once, after step offset_j = H-1 - floor((K-1-j) * H / K).
// The offsets are spread evenly over the period and aligned to its end: unit K-1 goes after
// the last step, so the period closes with a push as a full synchronization would. With H < K
// several units share a step. kInvalidArgument unless K >= 1 and H >= 1.
absl::StatusOr<SyncSchedule> StridedSchedule(uint32_t num_units, uint32_t period);

// Paper 003 PLSGD-ENP (Example 1): the units are split into n = min(H, K) sets of consecutive
// units; with K = q*n + r, sets 0..r-1 hold q+1 units and the others q. Units are assigned in
// descending order to ascending steps: set 0, synced after step 0, holds the highest units
// (whose backward ends first). Steps n..H-1 sync nothing. kInvalidArgument unless K >= 1 and
// H >= 1.
absl::StatusOr<SyncSchedule> EqualNumberSchedule(uint32_t num_units, uint32_t period);

// Paper 003 §3.3 (Algorithm 2): an interval partition of the units over the H steps, units in
// descending order across ascending steps, found by a depth-first search that decides for
// units K-1 down to 0 whether unit u joins the current step's set:
//  - Optimal Hiding: if u's transfer would end by F + B (communication-hidden), u joins.
//  - At-Least-One: if the current set is empty, u joins.
//  - Delayed CO assignment: otherwise (communication overflowed) the search branches: u joins,
//    or the current step closes and u opens the next one.
// The last step takes every remaining unit. Two safe cuts: a branch whose lower bound (the
// steps closed so far, the current one as it stands, F + B for each step after it) cannot beat
// the best complete schedule; and a branch that opens step h with unit u no sooner than an
// earlier branch did (steps are independent, so the rest would repeat). Ties keep the first
// schedule found (u joins before u is delayed). Under this cost model the properties are
// dominance rules, so the result is optimal over interval partitions (docs/algorithms.md).
// With fill_bubbles, FillBubbles then adds extra syncs (§3.4).
// kInvalidArgument on bad costs or H = 0.
absl::StatusOr<SyncSchedule> DreamDdpSchedule(const UnitCosts& costs, uint32_t period,
                                              bool fill_bubbles);

// The best interval partition by exhaustive search, for testing DreamDdpSchedule: every way of
// giving step h a count c_h >= 0 of units, sum c_h = K, units in descending order across
// ascending steps. Ties keep the first partition in the order that gives step 0 the most
// units. kInvalidArgument on bad costs, H = 0, or more than 10^7 partitions.
absl::StatusOr<SyncSchedule> BruteForceSchedule(const UnitCosts& costs, uint32_t period);

// Paper 003 §3.4 bubble filling. For each step, tries every unit not already in that step's
// set, highest index first (the late units, whose backward ends first), and keeps it when the
// step's time under the cost model does not increase; a unit that does not fit is skipped and
// the next one tried. Extra transfers thus fit in the link's idle time: before the step's own
// transfers, or after them while backward is still running. Push order stays descending unit
// index. A unit may then be synced more than once per period; the period time is unchanged.
// kInvalidArgument on bad costs, an invalid schedule, or a unit count that differs.
absl::StatusOr<SyncSchedule> FillBubbles(const UnitCosts& costs, const SyncSchedule& schedule);

// The schedule of `kind` for costs.num_units() units (strided and ENP read only the count),
// followed by FillBubbles when fill_bubbles is set.
absl::StatusOr<SyncSchedule> MakeSchedule(ScheduleKind kind, const UnitCosts& costs,
                                          uint32_t period, bool fill_bubbles);

// One step of the cost model with `units` pushed in that order. kInvalidArgument on bad costs
// or a unit index >= K.
absl::StatusOr<double> StepSeconds(const UnitCosts& costs, absl::Span<const uint32_t> units);

// Sum of the step times of the period. kInvalidArgument on bad costs, an invalid schedule, or
// a unit count that differs.
absl::StatusOr<double> PeriodSeconds(const UnitCosts& costs, const SyncSchedule& schedule);

// Per step: its time minus F + B (H entries, each >= 0). Errors as PeriodSeconds.
absl::StatusOr<std::vector<double>> StepOverflowSeconds(const UnitCosts& costs,
                                                        const SyncSchedule& schedule);

// The link a worker's pushes and pulls take.
struct LinkProfile {
  double bytes_per_second = 0;
  // Paid once by every transfer (one push plus one pull).
  double round_trip_seconds = 0;
};

// UnitCosts from a measured step time and the units' parameter counts. The costs are
// proportional, not measured per layer: forward takes 1/3 of the step and backward 2/3, each
// split over the units in proportion to their parameters (evenly when all counts are zero).
// transfer[u] = round_trip_seconds + 2 * params[u] * bytes_per_value / bytes_per_second (the
// unit is pushed and then pulled). kInvalidArgument naming the argument unless step_seconds
// is finite and >= 0, unit_params is not empty, bytes_per_value and bytes_per_second are
// finite and > 0 and round_trip_seconds is finite and >= 0.
absl::StatusOr<UnitCosts> UnitCostsFromProfile(double step_seconds,
                                               absl::Span<const uint64_t> unit_params,
                                               double bytes_per_value, const LinkProfile& link);

}  // namespace aloe

// The error boundary of a program we ship: one line per failure, a non-zero exit, no abort.
//
//   int main(int argc, char** argv) {
//     return fsdp::comm::RunMain([&] { ...; return 0; });
//   }
//
// Contract:
//  * RunMain runs `body` and returns its result when it returns.
//  * When `body` throws, or any thread of the process lets an exception escape (std::terminate,
//    e.g. a backend's worker thread), RunMain prints ONE line to stderr,
//      [rank R] error: <what>
//    (R from the RANK environment variable, or "?" without one; <what> is c10::Error's message
//    without its C++ backtrace, its lines joined with " | "), flushes stdout and stderr, and
//    ends the process at once with exit status 1 (std::_Exit). Nothing else runs: after a lost
//    peer, the destructors of process groups would join worker threads still blocked in
//    collectives with ranks that are gone (ProcessGroupGloo's does), and an abort would dump
//    core and a stack trace in every surviving rank.
//  * A process that serves its peers (rank 0's TCPStore holds the failure records the peers
//    read to tell a lost rank from one that stopped after its own error) waits the grace set
//    by SetExitGraceAfterError between the line and the exit; the TCPStore connection sets it
//    on the rank that serves the store.
//  * Before the line, every rank of the process writes its flight recorder dump (what it
//    issued last: comm/flight_recorder.h); while `body` runs, SIGUSR1 writes them on request
//    (installed where the signal's disposition was the default).
//  * Not re-entrant; call once, from main's thread.
#ifndef FSDP_COMM_MAIN_GUARD_H_
#define FSDP_COMM_MAIN_GUARD_H_

#include <chrono>
#include <exception>
#include <functional>
#include <string>

namespace fsdp::comm {

int RunMain(const std::function<int()>& body);

// See above; default 0. Thread-safe.
void SetExitGraceAfterError(std::chrono::milliseconds grace);

// Runs `hook(line)` (the error line) before RunMain ends the process after an error, e.g. to
// tell peers that this rank stops because of its own error (comm:gloo records it in the job's
// store). Hooks run in the order added; a throwing hook is ignored. Thread-safe.
void AddErrorExitHook(std::function<void(const std::string& line)> hook);

// The line RunMain prints for `error` (without the trailing newline); `rank` as given.
std::string ErrorLine(const std::string& rank, std::exception_ptr error);

}  // namespace fsdp::comm

#endif  // FSDP_COMM_MAIN_GUARD_H_

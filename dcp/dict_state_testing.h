// Test-only: a Stateful (dcp/stateful.h) that holds a state dict, its template on load.
#ifndef FSDP_DCP_DICT_STATE_TESTING_H_
#define FSDP_DCP_DICT_STATE_TESTING_H_

#include <utility>

#include "dcp/stateful.h"

namespace fsdp::dcp {

class DictState : public Stateful {
 public:
  explicit DictState(StateDict state) : state(std::move(state)) {}
  StateDict state_dict() const override { return state; }
  void load_state_dict(const StateDict& loaded) override {
    ++loads;
    state = loaded;
  }
  StateDict state;
  int loads = 0;  // load_state_dict calls
};

}  // namespace fsdp::dcp

#endif  // FSDP_DCP_DICT_STATE_TESTING_H_

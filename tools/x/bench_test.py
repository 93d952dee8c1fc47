"""./x bench (tools/x/bench.sh) with a fake bazel and fake benchmark binaries: --quick's one
repetition, the ratios and the callgrind budget, --peer's runs against PyTorch's FSDP."""
from fakes import XCase

BENCHES = ["comm_bench", "fsdp2_bench", "fsdp1_bench", "optim_state_bench", "dcp_bench", "hf_bench",
           "pipelining_bench", "e2e_bench"]


class Bench(XCase):
    def setUp(self):
        super().setUp()
        for b in BENCHES:
            self.x.program(f"bench/{b}")

    def runs(self, name):
        return [c[1:] for c in self.x.calls("program") if c[0] == f"bazel-bin/bench/{name}"]

    def test_quick(self):
        rc, out = self.x.run("bench", "--quick")
        self.assertEqual(rc, 0, out)
        self.assertEqual(self.x.calls("bazel")[0], ["build", "--config=opt", "//bench/...", "//train:train"])
        self.assertEqual(sorted(r[0] for r in self.runs("comm_bench")), ["0", "1"])
        self.assertEqual(self.runs("fsdp2_bench"), [["-", "--pair_repetitions=1",
                                                     "--benchmark_out=bench/out/fsdp2.json",
                                                     "--benchmark_out_format=json"]])
        self.assertEqual(len(self.x.calls("tools/bench_ratio.py")), 4)
        self.assertEqual(self.x.calls("tools/callgrind_bench.sh"), [[]])
        self.assertEqual(sorted(r[0] for r in self.runs("pipelining_bench")), ["0", "0", "1", "1", "2", "3"])
        self.assertEqual(self.runs("e2e_bench"), [])

    def test_peer(self):
        rc, out = self.x.run("bench", "--peer")
        self.assertEqual(rc, 0, out)
        self.assertIn("--pair_repetitions=5", self.runs("hf_bench")[0])
        runs = {(r[1], r[2], r[0]) for r in self.runs("e2e_bench")}
        self.assertEqual(len(self.runs("e2e_bench")), 2 * 2 * (2 + 4))
        self.assertIn(("--model=compute", "--fsdp=1", "3"), runs)
        self.assertEqual(self.x.calls("tools/e2e_table.py"), [["bench/out/e2e.jsonl"]])
        peer = [c[1:] for c in self.x.calls("python") if c[0] == self.x.peer_venv]
        self.assertIn("bench/peer/train_bench.py", [c[0] for c in peer])
        self.assertEqual(self.x.calls("tools/callgrind_pipelining.sh"), [[self.x.peer_venv + "/bin/python"]])

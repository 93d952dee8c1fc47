"""./x demo (tools/x/demo.sh) with a fake bazel and fake demo binaries: the build, the 4-rank
run and its 2-rank resume from build/demo, the Llama and trainer parts or their skip."""
from fakes import ROOT, FakeCheckout, XCase


class Demo(XCase):
    def setUp(self):
        super().setUp()
        self.programs()

    def programs(self):
        self.x.program("examples/fsdp2_demo")
        self.x.program("examples/llama/llama_demo")
        self.x.program("train/train")

    def ranks(self, name):
        prefix = "bazel-bin/" if name.startswith("train/") else "bazel-bin/examples/"
        return sorted(c[1:] for c in self.x.calls("program") if c[0] == prefix + name)

    def test_train_resume_and_llama(self):
        rc, out = self.x.run("demo", "--steps=3")
        self.assertEqual(rc, 0, out)
        self.assertEqual(self.x.calls("bazel")[0], ["build", "--config=opt", "//examples:fsdp2_demo",
                                                    "//examples/llama:llama_demo", "//train:train"])
        self.assertEqual(self.ranks("fsdp2_demo"),
                         sorted([[str(r), "--checkpoint_dir=build/demo", "--steps=3"] for r in range(4)] +
                                [[str(r), "--checkpoint_dir=build/demo", "--resume", "--steps=3"] for r in range(2)]))
        self.assertEqual(len(self.ranks("llama/llama_demo")), 6)
        peer = [c[1:] for c in self.x.calls("python") if c[0] == self.x.peer_venv]
        self.assertEqual(peer, [["examples/llama/testdata/hf_llama_fsdp2.py", "4", "20", "build/demo/llama_ref", "2"],
                                ["examples/llama/testdata/hf_check_export.py", "build/demo/llama_hf",
                                 "build/demo/llama_hf_logits.pt"],
                                ["train/testdata/make_hf_init.py", "build/demo/train_init"],
                                ["tools/plot_metrics.py", "build/demo/train/metrics.jsonl", "--output",
                                 "build/demo/train/curves.png"],
                                ["train/testdata/hf_check_train_export.py", "train/configs/demo.toml", "4"]])
        self.assertEqual(self.ranks("train/train"), [[str(r), "--config", "train/configs/demo.toml"] for r in range(4)])

    def test_llama_skipped_without_transformers(self):
        self.x.cleanup()
        self.x = FakeCheckout(ROOT, "no-peer")
        self.programs()
        rc, out = self.x.run("demo", env={"X_FAKE_FAIL": "pip"})
        self.assertEqual(rc, 0, out)
        self.assertIn("Llama demo skipped", out)
        self.assertIn("trainer demo skipped", out)
        self.assertEqual(self.ranks("train/train"), [])
        self.assertEqual(len(self.ranks("fsdp2_demo")), 6)
        self.assertEqual(self.ranks("llama/llama_demo"), [])

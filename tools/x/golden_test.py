"""./x golden (tools/x/golden.sh) with a fake peer venv: numpy installed, each generator run."""
import os

from fakes import ROOT, FakeCheckout, XCase


class Golden(XCase):
    def plant(self):
        os.makedirs(os.path.join(self.x.root, "testing/golden"))
        for g in ("gen_a.py", "gen_b.py"):
            open(os.path.join(self.x.root, "testing/golden", g), "w").close()

    def test_every_generator_with_the_peer_python(self):
        self.plant()
        rc, out = self.x.run("golden")
        self.assertEqual(rc, 0, out)
        self.assertIn([self.x.peer_venv, "-q", "--no-compile", "numpy"], self.x.calls("pip"))
        self.assertEqual([c[1:] for c in self.x.calls("python") if c[0] == self.x.peer_venv],
                         [["testing/golden/gen_a.py"], ["testing/golden/gen_b.py"]])

    def test_no_peer_venv_is_an_error(self):
        self.x.cleanup()
        self.x = FakeCheckout(ROOT, "no-peer")
        self.plant()
        rc, out = self.x.run("golden", env={"X_FAKE_FAIL": "pip"})
        self.assertEqual(rc, 1)
        self.assertIn("x: error: golden needs the peer venv", out)

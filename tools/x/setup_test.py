"""./x setup (tools/x/setup.sh) with fake apt, venvs and pip: nothing installed when all is
present, what a fresh machine installs, failures, .bazelrc.user and the links."""
import os

from fakes import XCase


class Present(XCase):
    def test_nothing_installed_and_the_files_written(self):
        rc, out = self.x.run("setup")
        self.assertEqual(rc, 0, out)
        self.assertEqual([c[0] for c in self.x.calls()], [], "no apt-get, venv or pip")
        self.assertIn("all present", out)
        self.assertEqual(os.readlink(os.path.join(self.x.root, "third_party/torch_root")), f"{self.x.state}/torch")
        c, r = self.x.cache, self.x.root
        self.assertEqual(self.x.read(".bazelrc.user"), f"""# Written by ./x setup; machine-specific, git-ignored.
build --disk_cache={c}/bazel-disk
build --linkopt=-Wl,-rpath,{self.x.state}/torch/lib
build --define=CUDA_ROOT={r}/third_party/cuda_root
build --define=TORCH_CUDA_DEPS={r}/third_party/torch_cuda_deps
test --test_env=FSDP_PEER_PYTHON={self.x.peer_venv}/bin/python
""")

    def test_a_missing_debian_package_is_installed(self):
        rc, out = self.x.run("setup", env={"X_FAKE_MISSING_DEBS": "clang-format"})
        self.assertEqual(rc, 0, out)
        self.assertIn("missing: clang-format", out)
        self.assertEqual(self.x.calls("apt-get"), [["update", "-q"],
                                                   ["install", "-y", "-q", "--no-install-recommends", "clang-format"]])

    def test_an_unreachable_registry_is_an_error(self):
        rc, out = self.x.run("setup", env={"X_FAKE_MISSING_DEBS": "clang-format", "X_FAKE_APT_RC": "100"})
        self.assertEqual(rc, 1)
        self.assertIn("x: error: apt-get update failed", out)


class Fresh(XCase):
    venvs = "none"

    def test_both_venvs_installed(self):
        rc, out = self.x.run("setup")
        self.assertEqual(rc, 0, out)
        v = self.x.version
        self.assertEqual(self.x.calls("venv"), [[self.x.venv], [self.x.peer_venv]])
        self.assertEqual(self.x.calls("pip"), [
            [self.x.venv, "-q", "--no-compile", "--no-deps", f"torch=={v}"],
            [self.x.peer_venv, "-q", "--no-compile", f"torch=={v}"],
            [self.x.peer_venv, "-q", "--no-compile", "transformers==5.24.0"],
            [self.x.peer_venv, "-q", "--no-compile", "torchtitan==0.3.0", "torchao==0.18.0", f"torch=={v}"],
            [self.x.peer_venv, "-q", "--no-compile", "matplotlib==3.11.2"]])
        self.assertIn("FSDP_PEER_PYTHON", self.x.read(".bazelrc.user"))

    def test_the_build_venv_failing_is_an_error(self):
        rc, out = self.x.run("setup", env={"X_FAKE_FAIL": "pip"})
        self.assertEqual(rc, 1)
        self.assertIn(f"x: error: pip install torch=={self.x.version} failed", out)


class NoPeer(XCase):
    venvs = "no-peer"

    def test_the_peer_venv_failing_is_a_warning(self):
        rc, out = self.x.run("setup", env={"X_FAKE_FAIL": "pip"})
        self.assertEqual(rc, 0, out)
        self.assertIn("peer tests will be skipped", out)
        self.assertNotIn("FSDP_PEER_PYTHON", self.x.read(".bazelrc.user"))

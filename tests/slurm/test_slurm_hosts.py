"""slurm/cluster.sh's edits of the machine, without starting a cluster: the node sizes its
slurm.conf gives, and its /etc/hosts edits, run on a copy (``ALBATROSS_HOSTS_FILE``): the block of
node names goes in and comes out leaving the file byte for byte as it was, whatever the file
holds (slashes, no final newline), and the leftovers of earlier versions are repaired. The real
/etc/hosts is compared before ``start`` and after ``stop`` by the ``slurm_cluster`` fixture."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BEGIN = "# >>> albatross slurm/cluster.sh nodes"
END = "# <<< albatross slurm/cluster.sh nodes"
# what the earlier versions' sed wrote in place of the opening marker
GARBAGE = "luster.sh nodes$/,/^# <<< albatross slurm/cluster.sh nodes$/d"

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "awk"], capture_output=True).returncode != 0, reason="no awk"
)


def test_nodes_get_every_cpu_whatever_omp_num_threads_says():
    """GNU nproc answers OMP_NUM_THREADS: started from a shell with OMP_NUM_THREADS=1, the nodes
    had one CPU each and sbatch refused every job with two tasks per node."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_THREAD_LIMIT="1")
    conf = subprocess.run(
        ["bash", str(REPO / "slurm" / "cluster.sh"), "config", "--nodes", "3"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cpus = re.findall(r"^NodeName=.* CPUs=(\d+) ", conf, flags=re.M)
    assert cpus == [str(len(os.sched_getaffinity(0)))] * 3, conf


def _cluster(tmp_path: Path, *args: str) -> None:
    env = dict(
        os.environ,
        ALBATROSS_HOSTS_FILE=str(tmp_path / "hosts"),
        ALBATROSS_SLURM_DIR=str(tmp_path / "state"),
    )
    subprocess.run(["bash", str(REPO / "slurm" / "cluster.sh"), *args], env=env, check=True)


@pytest.mark.parametrize(
    "original",
    [
        b"127.0.0.1 localhost\n::1 localhost ip6-localhost\n",
        b"127.0.0.1 localhost\n# a comment / with slashes /etc/hosts\n10.0.0.1 gpu01",  # no final \n
        b"",
    ],
    ids=["plain", "slashes-no-final-newline", "empty"],
)
def test_write_then_remove_gives_back_the_file_byte_for_byte(tmp_path, original):
    hosts = tmp_path / "hosts"
    hosts.write_bytes(original)
    _cluster(tmp_path, "hosts-write", "2")
    text = hosts.read_text()
    assert text.count(BEGIN) == 1 and "127.0.10.2 albatross-node2\n" in text
    _cluster(tmp_path, "hosts-write", "3")  # a restart with more nodes: still one block
    text = hosts.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and "albatross-node3" in text
    _cluster(tmp_path, "hosts-remove")
    assert hosts.read_bytes() == original


def test_remove_repairs_what_earlier_versions_left(tmp_path):
    block = f"{GARBAGE}\n127.0.10.1 albatross-node1\n127.0.10.2 albatross-node2\n{END}\n"
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{block}10.0.0.1 gpu01\n{block}")
    _cluster(tmp_path, "hosts-write", "2")  # repairs and writes one clean block
    text = hosts.read_text()
    assert GARBAGE not in text and text.count(BEGIN) == 1 and text.count(END) == 1
    _cluster(tmp_path, "hosts-remove")
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.1 gpu01\n"


def test_an_unclosed_marker_keeps_the_lines_after_it(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{BEGIN}\n10.0.0.1 gpu01\n")
    _cluster(tmp_path, "hosts-remove")
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.1 gpu01\n"

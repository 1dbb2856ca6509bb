"""How a run starts and ends: the run_dir lock (``lock``), stop signals and preemption
(``preemption``), the step watchdog (``watchdog``), a lost peer and the group's teardown
(``peers``), full disks (``disk``), and the exit codes and one-paragraph exits of the
scripts (``exit``)."""

"""Measuring the schedulers: an emulated cluster, the bench, the ideal bound, a simulator.

- :mod:`prophet_tf.bench.netns`: hosts in network namespaces with tc-shaped links.
- :mod:`prophet_tf.bench.bench_cli`: ``prophet-tf bench``; :mod:`prophet_tf.bench.runner`: a
  configuration's runs; :mod:`prophet_tf.bench.training_run`: one run;
  :mod:`prophet_tf.bench.results`: its JSON and table.
- :mod:`prophet_tf.bench.worker`: the training process of one bench worker.
- :mod:`prophet_tf.bench.models`: the bench models and per-variable compute profiles.
- :mod:`prophet_tf.bench.ideal`: the ideal step time of a run.
- :mod:`prophet_tf.bench.simulate`: the simulation, driving the engine's dispatch and schedulers;
  :mod:`prophet_tf.bench.simulate_network`: its event queue and links shared by flows;
  :mod:`prophet_tf.bench.simulate_max_min`: the flows' max-min fair rates;
  :mod:`prophet_tf.bench.simulate_rate_lag`: those rates recomputed at most once per lag;
  :mod:`prophet_tf.bench.simulate_links`: the links of a cluster layout;
  :mod:`prophet_tf.bench.simulate_flow_share`: ``share_sigma`` fitted to a measured link;
  :mod:`prophet_tf.bench.simulate_sweep`: a scheduler spec's simulation, and the sweep;
  :mod:`prophet_tf.bench.simulate_cli`: ``prophet-tf simulate``.
- :mod:`prophet_tf.bench.report`: the docs' result tables from committed JSON (``prophet-tf
  report``; :mod:`prophet_tf.bench.cut_table`: the partition-cut experiment's).
- :mod:`prophet_tf.bench.emulation`: emulated compute time that leaves the CPU free (``delay``);
  :mod:`prophet_tf.bench.emulated`: models whose compute is emulated from a profile.

Nothing outside ``prophet_tf.bench`` and ``prophet_tf.tools`` imports this
package (the bench's fallback shaping inside the transport is
:mod:`prophet_tf.ps.shaping`). TensorFlow is
imported only by the worker, the profiler and the emulated models.
"""

"""The fake device: a capture that runs a step on shapes only, with no memory behind its
tensors (FakeTensorMode), as the target GPU would run it. The mode and the values it cannot
know (fake_mode, fake_values, known_reads, fake_idioms), every allocation at an address of its
own and its frees written into the trace (meta_storage, free_markers), the stand-ins for DDP's
reducer and torch.compile's kernels (fake_ddp, fake_reducer, fake_buckets, compiled_on_fake),
the target GPU's kernels (cuda_dispatch, cuda_attention, sdpa_choice) and the trace's
subclass frames and process-group names (subclass_frames, group_names). Nothing here knows a
workload or the recorder."""

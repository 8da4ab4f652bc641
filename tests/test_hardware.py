from trex.hardware import load_profiles, profile_for_device_name


def test_profiles_cite_sources_and_units():
    profiles = load_profiles()
    assert {"h100-sxm", "h200-sxm", "b200", "ascend-910c-die"} <= set(profiles)
    for p in profiles.values():
        assert p.unit in ("card", "die") and p.source and p.peak_flops("bf16") > 1e14


def test_device_names_map_to_profiles(tmp_path, monkeypatch):
    assert profile_for_device_name("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert profile_for_device_name("Ascend910_9391").name == "ascend-910c-die"
    assert profile_for_device_name("cpu") is None
    (tmp_path / "mine.toml").write_text(
        'name = "mine"\nunit = "card"\npeak_tflops = { bf16 = 100.0 }\nmemory_gib = 32\n'
        'intra_node_gbps = 10\ninter_node_gbps = 1\ndevices_per_node = 4\nmatch = ["MyChip"]\nsource = "me"\n')
    monkeypatch.setenv("TREX_HARDWARE_DIR", str(tmp_path))
    assert profile_for_device_name("MyChip v2").peak_flops("bf16") == 1e14

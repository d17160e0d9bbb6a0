"""`ctl fabric-test`'s pure parts: reading ib_write_bw's output (the fixtures
are in its exact format; tests/fixtures/fabric_test/README.md says what each
is modelled on), the unit conversion, grading against the link rate, the
table the CLI prints, its exit code, and the command lines the agents run."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.agent.fabric_bench import (
    FabricBenchError,
    client_args,
    parse_ib_write_bw,
    server_args,
    to_gbps,
)
from llmgw.errors import LlmgwError
from llmgw.protocol.fabric_test import (
    FabricTestError,
    Grade,
    RailResult,
    exit_code,
    grade,
    percent_of_link,
    render_table,
    summary,
)

FIX = Path(__file__).parent.parent / "fixtures" / "fabric_test"


def run(name: str) -> tuple[str, str]:
    """A fixture's stdout and stderr; a stream with no file printed nothing."""
    out, err = FIX / f"{name}.stdout", FIX / f"{name}.stderr"
    return (out.read_text() if out.exists() else "", err.read_text() if err.exists() else "")


def parsed(name: str):
    return parse_ib_write_bw(*run(name))


# ------------------------------------------------------------ runs that went through


def test_an_ndr_client_run_reads_as_390_gbps_on_infiniband_with_no_gid_and_no_peak():
    o = parsed("ib_ndr_client")
    assert (o.link_type, o.device, o.gid_index, o.mtu_bytes) == ("IB", "mlx5_0", None, 4096)
    assert o.unit == "Gb/sec"
    assert o.bw_average_gbps == pytest.approx(390.14)
    # -D means perftest measures no peak and prints 0.00: that is "not measured", not zero.
    assert o.bw_peak_gbps is None
    assert o.msg_rate_mpps == pytest.approx(0.744133)
    assert (o.message_bytes, o.iterations) == (65536, 4464798)
    assert o.error is None and not o.retryable


def test_the_server_side_reads_the_same_figures_as_the_client_because_it_prints_the_clients_report():
    client, server = parsed("ib_ndr_client"), parsed("ib_ndr_server")
    assert server.error is None
    assert (server.bw_average_gbps, server.msg_rate_mpps, server.iterations) == (
        client.bw_average_gbps,
        client.msg_rate_mpps,
        client.iterations,
    )


def test_a_roce_run_reports_ethernet_and_the_gid_index_it_ran_on():
    o = parsed("roce_client")
    assert (o.link_type, o.device, o.gid_index) == ("Ethernet", "mlx5_0", 3)
    assert o.bw_average_gbps == pytest.approx(185.32)
    assert grade(o.bw_average_gbps, 200) == Grade.OK


def test_a_rail_at_about_half_its_rate_reads_as_measured_and_grades_slow():
    o = parsed("ib_ndr_slow_client")
    assert o.device == "mlx5_2"
    assert o.bw_average_gbps == pytest.approx(211.47)
    assert grade(o.bw_average_gbps, 400) == Grade.SLOW


def test_a_table_in_mb_per_second_is_converted_to_gbits_with_perftests_mebibyte():
    o = parsed("hdr_mbsec_client")
    assert o.unit == "MB/sec"
    assert o.bw_average_gbps == pytest.approx(23459.20 * 2**20 * 8 / 1e9)
    assert o.bw_average_gbps == pytest.approx(196.79, abs=0.01)
    # Without -D perftest measures a peak, and it is kept.
    assert o.bw_peak_gbps == pytest.approx(23537.87 * 2**20 * 8 / 1e9)
    assert o.iterations == 5000
    assert o.error is None


def test_newer_perftests_mib_per_second_heading_reads_the_same_as_mb_per_second():
    out, err = run("hdr_mbsec_client")
    newer = out.replace("[MB/sec]", "[MiB/sec]")
    assert parse_ib_write_bw(newer, err).bw_average_gbps == parse_ib_write_bw(out, err).bw_average_gbps
    assert parse_ib_write_bw(newer, err).unit == "MiB/sec"


def test_a_cpu_frequency_warning_between_the_heading_and_the_row_is_skipped_when_the_streams_are_merged():
    out, err = run("hdr_mbsec_client")
    heading = next(ln for ln in out.splitlines() if "BW average[" in ln)
    merged = out.replace(heading, heading + "\n" + err.strip())
    assert parse_ib_write_bw(merged, "").bw_average_gbps == pytest.approx(196.79, abs=0.01)


def test_the_average_is_found_by_its_heading_when_the_qos_layout_puts_a_column_in_front():
    # perftest's RESULT_FMT_G_QOS and REPORT_FMT_QOS: an #sl column before #iterations.
    out = (
        " #bytes    #sl      #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
        " 65536      3           4464798           0.00               390.14                  0.744133\n"
    )
    o = parse_ib_write_bw(out, "")
    assert o.bw_average_gbps == pytest.approx(390.14)
    assert o.iterations == 4464798


def test_a_refused_connection_says_the_peers_server_was_not_listening_and_may_be_retried():
    o = parsed("retry_1_refused")
    assert o.error == "the peer's ib_write_bw server was not listening at 10.0.0.2:18515"
    assert o.retryable
    assert o.bw_average_gbps is None


def test_the_retry_after_a_refusal_reads_as_a_normal_run():
    o = parsed("retry_2_success")
    assert o.error is None and not o.retryable
    assert o.bw_average_gbps == pytest.approx(389.87)


# ------------------------------------------------------------ runs that failed


def test_an_rtr_failure_on_roce_with_an_all_zero_gid_names_the_gid_index_as_the_cause():
    o = parsed("rtr_roce_zero_gid")
    assert (o.link_type, o.device, o.gid_index) == ("Ethernet", "mlx5_2", 0)
    assert o.error is not None
    assert "GID index 0" in o.error and "all zeros" in o.error and "RTR" in o.error
    assert not o.retryable
    assert o.bw_average_gbps is None


def test_an_rtr_failure_on_roce_with_a_gid_that_is_set_still_points_at_the_gid_index():
    out, err = run("rtr_roce_zero_gid")
    out = out.replace(
        "00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00", "00:00:00:00:00:00:00:00:00:00:255:255:10:01:00:21"
    )
    o = parse_ib_write_bw(out, err)
    assert o.error is not None and "all zeros" not in o.error
    assert "GID index 0" in o.error and "RoCE v2" in o.error


def test_an_rtr_failure_on_infiniband_says_the_ports_cannot_reach_each_other_and_not_gid():
    o = parsed("rtr_ib")
    assert o.link_type == "IB"
    assert o.error is not None
    assert "RTR" in o.error and "cannot reach each other" in o.error and "GID" not in o.error


def test_a_missing_adapter_is_named_in_the_error():
    o = parsed("device_not_found")
    assert o.error == "there is no RDMA adapter named mlx5_9 on this node"
    assert not o.retryable


def test_a_device_that_cannot_be_queried_points_at_mismatched_verbs_and_driver():
    o = parsed("device_attributes")
    assert o.error is not None and "verbs library" in o.error and "kernel driver" in o.error


def test_an_unreadable_gid_points_at_the_gid_index():
    o = parsed("gid_index_unreadable")
    assert o.error is not None and "GID index" in o.error


def test_a_failed_work_completion_is_told_in_rdma_cores_words():
    err = " Completion with error at client\n Failed status 12: wr_id 0 syndrom 0x81\nscnt=128, ccnt=0\n"
    o = parse_ib_write_bw("", err)
    assert o.error is not None and "transport retry counter exceeded" in o.error


def test_a_run_that_printed_nothing_says_so_and_an_unknown_failure_quotes_its_last_line():
    assert parse_ib_write_bw("", "").error == "ib_write_bw printed nothing"
    o = parse_ib_write_bw(" WARNING: BW peak won't be measured in this run.\n", "something new went wrong\n")
    assert o.error == "ib_write_bw printed no result: something new went wrong"


# ------------------------------------------------------------ units


def test_a_mebibyte_a_second_is_0_008388608_gbits_and_perftests_stated_factor_agrees():
    assert to_gbps(1.0, "MB/sec") == pytest.approx(0.008388608)
    assert to_gbps(1.0, "MiB/sec") == to_gbps(1.0, "MB/sec")
    # perftest's help: "Factor=10^9/(2^20*8)=119.2; MiB=Gb_result * factor".
    assert to_gbps(119.2, "MB/sec") == pytest.approx(1.0, abs=1e-3)
    assert to_gbps(390.14, "Gb/sec") == 390.14


def test_an_unknown_unit_is_refused_rather_than_guessed():
    with pytest.raises(FabricBenchError, match="GB/min"):
        to_gbps(1.0, "GB/min")
    assert issubclass(FabricBenchError, LlmgwError)
    # In a run's output it becomes the run's error, not a figure in the wrong unit.
    out, err = run("ib_ndr_client")
    o = parse_ib_write_bw(out.replace("[Gb/sec]", "[GB/min]"), err)
    assert o.bw_average_gbps is None
    assert o.error is not None and "GB/min" in o.error


# ------------------------------------------------------------ grading


@pytest.mark.parametrize(
    ("measured", "expected"),
    [
        (400.0, Grade.OK),
        (320.0, Grade.OK),  # exactly 80 %
        (319.99, Grade.SLOW),
        (200.0, Grade.SLOW),  # exactly 50 %
        (199.99, Grade.FAIL),
        (0.0, Grade.FAIL),  # nothing got through
        (None, Grade.FAIL),
    ],
)
def test_a_rail_is_ok_from_80_percent_slow_from_50_and_fails_below_or_with_nothing_through(measured, expected):
    assert grade(measured, 400) == expected


def test_a_link_rate_that_is_not_positive_cannot_grade_a_rail():
    for bad in (0, -400, float("nan")):
        with pytest.raises(FabricTestError):
            grade(300, bad)
    assert issubclass(FabricTestError, LlmgwError)


def test_the_percentage_shown_rounds_down_so_it_never_reads_80_beside_slow():
    assert percent_of_link(319.6, 400) == 79
    assert percent_of_link(320.0, 400) == 80
    assert percent_of_link(388.2, 400) == 97


# ------------------------------------------------------------ the table


def _rails() -> list[RailResult]:
    return [
        RailResult(adapter="mlx5_0", peer_adapter="mlx5_0", link_rate_gbps=400, measured_gbps=388.2, grade=Grade.OK),
        RailResult(adapter="mlx5_2", peer_adapter="mlx5_2", link_rate_gbps=400, measured_gbps=212.4, grade=Grade.SLOW),
        RailResult(
            adapter="mlx5_3",
            peer_adapter="mlx5_3",
            link_rate_gbps=None,
            measured_gbps=None,
            grade=Grade.FAIL,
            detail="the peer's ib_write_bw server was not listening at 10.0.0.2:18515",
        ),
    ]


def test_the_table_prints_the_heading_aligned_rails_notes_and_summary_exactly():
    text = render_table("gpu-a", "gpu-b", "ib-a", _rails(), took_s=14.26, notes=["mlx5_1 is not on ib-a on gpu-b"])
    assert text == (
        "gpu-a → gpu-b on ib-a, 14.3s\n"
        "\n"
        "RAIL             LINK      MEASURED    VERDICT  DETAIL\n"
        "mlx5_0 → mlx5_0  400 Gb/s  388.2 Gb/s  ok       97% of 400 Gb/s\n"
        "mlx5_2 → mlx5_2  400 Gb/s  212.4 Gb/s  slow     53% of 400 Gb/s\n"
        "mlx5_3 → mlx5_3  -         -           fail     the peer's ib_write_bw server was not listening at 10.0.0.2:18515\n"
        "note: mlx5_1 is not on ib-a on gpu-b\n"
        "\n"
        "1 of 3 rails passed; mlx5_2 is slow: 212 Gb/s of 400; "
        "mlx5_3 failed: the peer's ib_write_bw server was not listening at 10.0.0.2:18515\n"
    )


def test_the_summary_matches_the_issues_example_for_one_slow_rail_of_four():
    rails = [
        RailResult(
            adapter=f"mlx5_{i}", peer_adapter=f"mlx5_{i}", link_rate_gbps=400, measured_gbps=390.0, grade=Grade.OK
        )
        for i in (0, 1, 3)
    ]
    rails.insert(
        2,
        RailResult(adapter="mlx5_2", peer_adapter="mlx5_2", link_rate_gbps=400, measured_gbps=212.4, grade=Grade.SLOW),
    )
    assert summary(rails) == "3 of 4 rails passed; mlx5_2 is slow: 212 Gb/s of 400"
    assert summary(rails[:2]) == "2 of 2 rails passed"


def test_a_rail_with_nothing_through_and_no_reason_says_nothing_got_through():
    r = RailResult(adapter="mlx5_0", peer_adapter="mlx5_0", link_rate_gbps=400, grade=Grade.FAIL)
    assert "nothing got through" in render_table("a", "b", "ib-a", [r])
    assert summary([r]) == "0 of 1 rails passed; mlx5_0 failed: nothing got through"


def test_a_rail_between_differently_named_adapters_names_both_in_the_summary():
    r = RailResult(adapter="mlx5_0", peer_adapter="mlx5_4", link_rate_gbps=200, measured_gbps=90.0, grade=Grade.FAIL)
    assert summary([r]) == "0 of 1 rails passed; mlx5_0 → mlx5_4 failed: 90 Gb/s of 200"


def test_the_heading_leaves_out_the_time_when_it_is_not_known_and_gives_minutes_past_one():
    assert render_table("a", "b", "ib-a", []).splitlines()[0] == "a → b on ib-a"
    assert render_table("a", "b", "ib-a", [], took_s=125).splitlines()[0] == "a → b on ib-a, 2m05s"
    assert render_table("a", "b", "ib-a", []).rstrip().endswith("no rails were tested")


def test_the_command_exits_zero_only_when_every_rail_is_ok():
    ok = RailResult(adapter="mlx5_0", peer_adapter="mlx5_0", link_rate_gbps=400, measured_gbps=390, grade=Grade.OK)
    assert exit_code([ok, ok]) == 0
    assert exit_code(_rails()) == 1
    assert exit_code([ok, _rails()[1]]) == 1
    # No rails tested showed nothing to work.
    assert exit_code([]) == 1


def test_a_rail_result_travels_as_json_and_ignores_fields_a_newer_peer_adds():
    r = _rails()[1]
    back = RailResult.model_validate_json(r.model_dump_json())
    assert back == r
    newer = RailResult.model_validate({**r.model_dump(mode="json"), "jitter_us": 3})
    assert newer.grade == Grade.SLOW and newer.grade == "slow"


# ------------------------------------------------------------ command lines


def test_the_client_command_line_is_perftests_flags_with_the_server_address_last():
    expected = "ib_write_bw -d mlx5_0 -i 1 -p 18515 -D 10 -F --report_gbits 10.0.0.2"
    assert client_args("mlx5_0", 1, None, "10.0.0.2", 10, 18515) == expected.split()


def test_the_server_command_line_has_no_address_and_roce_adds_the_gid_index():
    expected = "ib_write_bw -d mlx5_0 -i 1 -p 18515 -D 10 -F --report_gbits -x 3"
    assert server_args("mlx5_0", 1, 3, 10, 18515) == expected.split()
    roce_client = client_args("mlx5_0", 1, 3, "10.0.0.2", 3, 18516, binary="/usr/bin/ib_write_bw")
    assert roce_client[0] == "/usr/bin/ib_write_bw"
    assert roce_client[-3:] == ["-x", "3", "10.0.0.2"]
    assert roce_client[roce_client.index("-p") + 1] == "18516"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seconds": 0},
        {"seconds": 31},  # the spec's ceiling is 30
        {"device": "-x"},  # would be read as a flag
        {"device": "mlx5 0"},
        {"server_address": "--all"},
        {"tcp_port": 70000},
        {"port": 0},
        {"gid_index": -1},
    ],
)
def test_a_command_line_that_would_not_mean_what_was_asked_is_refused(kwargs):
    args = {
        "device": "mlx5_0",
        "port": 1,
        "gid_index": None,
        "server_address": "10.0.0.2",
        "seconds": 10,
        "tcp_port": 18515,
    }
    with pytest.raises(FabricBenchError):
        client_args(**{**args, **kwargs})

//! End-to-end connector scenarios as functions over a [`TransportFactory`], so every
//! transport runs the same list: [`pull_scenarios!`](crate::pull_scenarios) and
//! [`push_scenarios!`](crate::push_scenarios) generate one `#[test]` per scenario.
//!
//! [`TransportFactory`]: crate::conformance::TransportFactory

pub mod digest;
pub mod pull;
pub mod push;
pub mod push_digest;
pub mod stamped;

/// Generates one `#[test]` per pull scenario. `$run` is called as `$run(case, body)` and
/// calls `body(&factory)` (or prints why it skips).
#[macro_export]
macro_rules! pull_scenarios {
    ($run:path) => {
        $crate::scenario_tests!($run, pull: tp_combinations_move_the_right_bytes,
            replicated_heads_and_mla, five_concurrent_requests,
            full_prefix_hit_only_notifies_and_partial_hit_reads_the_tail,
            layout_mismatch_is_refused_naming_fields,
            handshake_failure_returns_request_with_invalid_blocks,
            failure_policy_reaches_the_report,
            loads_never_block_on_a_slow_handshake, lease_expiry_frees_held_blocks,
            compat_enforcement_can_be_disabled, setup_failure_returns_invalid_blocks,
            per_layer_windows_move_only_the_last_blocks, hybrid_groups_move_each_groups_blocks,
            state_beside_attention_moves_whole_pages,
            a_failed_setup_is_reported_only_after_its_posted_reads_ended,
            a_prefill_with_another_block_size_is_read_by_token_ranges,
            consumed_foreign_and_unstamped_references_fail_their_loads,
            an_expired_lease_refutes_its_reference,
            the_prefill_holds_the_blocks_until_their_stamp_was_read,
            a_request_held_again_keeps_only_its_new_reference,
            a_reference_read_before_its_hold_started_loads_once_it_starts,
            a_reference_never_held_fails_at_the_transfer_timeout,
            an_unsent_read_done_note_is_counted_and_the_blocks_stay_held,
            content_digests_verify_correct_loads_across_tp_sizes,
            a_corrupted_read_and_a_changed_source_fail_their_loads,
            a_decode_with_digests_refuses_a_prefill_without_them);
    };
}

/// Generates one `#[test]` per push scenario, like [`pull_scenarios!`](crate::pull_scenarios).
#[macro_export]
macro_rules! push_scenarios {
    ($run:path) => {
        $crate::scenario_tests!($run, push: single_room_chunked_with_aux,
            layer_by_layer_sends_complete_rooms,
            heterogeneous_tp_replication_and_mla, pipeline_stages_including_an_uneven_split,
            many_rooms_concurrently, mamba_and_window_state, dummy_ranks_complete_without_data,
            registry_not_ready_then_ready, page_size_or_dtype_mismatch_is_refused,
            out_of_range_destinations_are_refused_with_guards_intact,
            prefill_death_fails_its_rooms_within_the_heartbeat_window,
            waiting_and_bootstrap_timeouts, abort_reaches_the_other_side,
            an_aborted_room_drains_only_after_its_writes_stopped,
            restarted_prefill_at_the_same_address_serves_new_rooms,
            malformed_control_messages_are_dropped_and_serving_continues,
            room_requested_before_the_engine_adds_it, hybrid_groups_write_each_groups_pages,
            state_group_beside_attention_writes_whole_pages);
        $crate::scenario_tests!($run, push_digest:
            content_digests_verify_rooms_across_tp_stages_and_mla,
            a_corrupted_write_and_a_changed_source_fail_their_rooms);
    };
}

/// One `#[test]` per named scenario of module `$module`.
#[doc(hidden)]
#[macro_export]
macro_rules! scenario_tests {
    ($run:path, $module:ident: $($case:ident),+ $(,)?) => {
        $(
            #[test]
            fn $case() {
                $run(stringify!($case), |f| $crate::scenarios::$module::$case(f));
            }
        )+
    };
}

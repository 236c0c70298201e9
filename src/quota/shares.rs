//! A tenant's concurrent slots (downloads streaming, requests in progress, bodies arriving,
//! estimates) shared between its principals, so that no principal — however slow or hostile its
//! clients — can hold them all: one principal holds at most half of them (rounded up), and the
//! partners together leave a quarter (rounded down, at least one) to the admins. With the
//! default 8 slots a partner holds at most 4, all partners at most 6, and the admins (who count
//! as one principal, as in the rate limits) always find 2 free of partners; any other partner
//! finds at least 2 free of one partner. A tenant with a single holder (only admins, or one
//! partner and no admin) has all of its slots: there is nobody to share with.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::auth::Caller;

/// Who holds a slot: the tenant's admins together, or one partner.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Holder {
    Admins,
    Partner(String),
}

impl Holder {
    pub fn of(caller: &Caller) -> Holder {
        if caller.principal.is_admin() { Holder::Admins } else { Holder::Partner(caller.principal.id.to_string()) }
    }
}

#[derive(Default)]
struct Held {
    total: u32,
    partners: u32,
    by_holder: HashMap<Holder, u32>,
}

/// `capacity` slots of one tenant with per-principal shares.
pub struct SharedSlots {
    capacity: u32,
    /// Most slots one holder may have.
    per_holder: u32,
    /// Most slots the partners together may have.
    partners_together: u32,
    held: Mutex<Held>,
}

/// One slot, returned when dropped.
pub struct Slot {
    slots: Arc<SharedSlots>,
    holder: Holder,
}

impl SharedSlots {
    /// `capacity` slots shared by `holders` holders: each may take half (rounded up).
    pub fn new(capacity: u32, holders: usize) -> Arc<SharedSlots> {
        let capacity = capacity.max(1);
        SharedSlots::with_per_holder(capacity, capacity.div_ceil(2), holders)
    }

    /// `capacity` slots of which each of `holders` holders may take `per_holder`.
    pub fn with_per_holder(capacity: u32, per_holder: u32, holders: usize) -> Arc<SharedSlots> {
        let capacity = capacity.max(1);
        let (per_holder, partners_together) = match (holders, capacity) {
            (0 | 1, _) => (capacity, capacity),
            (_, 1) => (1, 1),
            (_, n) => (per_holder.clamp(1, n), n - (n / 4).max(1)),
        };
        Arc::new(SharedSlots { capacity, per_holder, partners_together, held: Mutex::new(Held::default()) })
    }

    /// A slot for `holder`, or `None` when the tenant's slots, the holder's share or (for a
    /// partner) the partners' share are all taken.
    pub fn try_take(self: &Arc<Self>, holder: Holder) -> Option<Slot> {
        let mut held = self.held.lock().expect("not poisoned");
        let mine = held.by_holder.get(&holder).copied().unwrap_or(0);
        let partner = matches!(holder, Holder::Partner(_));
        if held.total >= self.capacity
            || mine >= self.per_holder
            || (partner && held.partners >= self.partners_together)
        {
            return None;
        }
        held.total += 1;
        held.partners += u32::from(partner);
        *held.by_holder.entry(holder.clone()).or_default() += 1;
        Some(Slot { slots: self.clone(), holder })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().expect("not poisoned");
        held.total -= 1;
        held.partners -= u32::from(matches!(self.holder, Holder::Partner(_)));
        if let Some(mine) = held.by_holder.get_mut(&self.holder) {
            *mine -= 1;
            if *mine == 0 {
                held.by_holder.remove(&self.holder);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partner(id: &str) -> Holder {
        Holder::Partner(id.into())
    }

    #[test]
    fn one_partner_holds_half_and_partners_leave_a_quarter_to_the_admins() {
        let slots = SharedSlots::new(8, 4);
        let mallory: Vec<_> = std::iter::from_fn(|| slots.try_take(partner("mallory"))).collect();
        assert_eq!(mallory.len(), 4, "one partner: half");
        let trudy: Vec<_> = std::iter::from_fn(|| slots.try_take(partner("trudy"))).collect();
        assert_eq!(trudy.len(), 2, "the partners together: three quarters");
        assert!(slots.try_take(partner("carol")).is_none());
        let admins: Vec<_> = std::iter::from_fn(|| slots.try_take(Holder::Admins)).collect();
        assert_eq!(admins.len(), 2, "the admins find the rest");
        drop(mallory);
        assert!(slots.try_take(partner("carol")).is_some(), "slots come back when dropped");
    }

    #[test]
    fn a_holder_that_returns_one_of_its_slots_may_take_back_only_that_one() {
        let slots = SharedSlots::new(8, 4);
        let mut mallory: Vec<_> = std::iter::from_fn(|| slots.try_take(partner("mallory"))).collect();
        assert_eq!(mallory.len(), 4);
        mallory.pop();
        let again = slots.try_take(partner("mallory"));
        assert!(again.is_some(), "the slot it returned");
        assert!(slots.try_take(partner("mallory")).is_none(), "still three held: back at its share");
    }

    #[test]
    fn a_single_slot_is_anyones_and_small_tenants_still_share() {
        let one = SharedSlots::new(1, 3);
        let held = one.try_take(partner("p")).expect("the only slot");
        assert!(one.try_take(Holder::Admins).is_none());
        drop(held);
        assert!(one.try_take(Holder::Admins).is_some());
        let two = SharedSlots::new(2, 2);
        let _a = two.try_take(partner("p")).unwrap();
        assert!(two.try_take(partner("p")).is_none(), "half of two is one");
        assert!(two.try_take(Holder::Admins).is_some());
        let alone = SharedSlots::new(8, 1);
        let held: Vec<_> = std::iter::from_fn(|| alone.try_take(Holder::Admins)).collect();
        assert_eq!(held.len(), 8, "nobody to share with");
        let estimates = SharedSlots::with_per_holder(4, 1, 5);
        let partners: Vec<_> = ["a", "b", "c", "d"].iter().filter_map(|p| estimates.try_take(partner(p))).collect();
        assert_eq!(partners.len(), 3, "one each, a quarter left to the admins");
        assert!(estimates.try_take(Holder::Admins).is_some());
    }
}
